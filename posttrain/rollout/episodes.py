"""Multi-turn episodes on the engine, token in / token out.

Each episode is one growing token sequence (see chat_tokens): the opening prompt, then turn after turn the
model's sampled tokens (kept with their logprobs and policy versions) and the environment's observations
(a template delta). Every model turn is a new engine request over the whole sequence so far, and the
engine's prefix cache serves the episode's earlier blocks from the previous turn: only the observation and
the new tokens are computed (`Episode.reused_tokens` counts what the cache served on turns 2+).

The loop drives `LLMEngine.add_request / step` itself, so episodes at different turns decode together in one
continuous batch while environments run on worker threads (`EnvWorkers`): a finished turn hands its parsed
text to `env.step` on a worker, and the engine goes on with every other episode meanwhile. Environment calls
(construction + reset, step, episode_reward) are bounded by `step_timeout_s`; a call that overruns ends its
episode truncated (`env_timeouts`), one that raises ends it unscorable (`env_errors`).

Limits end an episode *truncated*: `max_turns` model turns, `max_episode_tokens` tokens after the opening
prompt (model and observation tokens together), and a turn that reaches `max_tokens` without its
end-of-turn token (nothing well-formed to hand the environment).

Determinism: every turn is a request seeded from its episode's seed and the turn's number, so an episode's
tokens depend on neither the batch nor how the worker threads interleave.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

from posttrain.engine import SamplingParams
from posttrain.engine.llm_engine import LLMEngine
from posttrain.envs import Environment, EnvStep, Message
from posttrain.envs.tool_calls import ToolCallParser
from posttrain.errors import PosttrainError
from posttrain.rollout.chat_tokens import ChatTokens
from posttrain.rollout.env_workers import EnvWorkers

TRUNCATED = frozenset({"max_turns", "max_episode_tokens", "turn_length", "env_timeout"})
_request_numbers = itertools.count()


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens: int  # per model turn
    max_episode_tokens: int  # after the opening prompt: model and observation tokens together
    max_prompt_tokens: int  # the opening prompt
    step_timeout_s: float  # one environment call (reset, step, episode_reward)


@dataclass
class Episode:
    """One episode: its row, its conversation, and its token sequence after the opening prompt."""

    row: Mapping[str, Any]
    seed: int | None
    env: Environment | None = None
    messages: list[Message] = field(default_factory=list)  # the conversation (opening, turns, observations)
    num_opening: int = 0  # how many of `messages` opened the episode
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # everything after the prompt, as the model saw it
    model_mask: list[int] = field(default_factory=list)  # per id: 1 sampled by the model, 0 observation
    logprobs: list[float] = field(default_factory=list)  # per id: the engine's; 0.0 (unused) on observations
    policy_versions: list[int] = field(default_factory=list)  # per model turn
    # per id: the version its token was drawn under; an observation token repeats the model token's before it
    token_versions: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)  # the environment's per-step rewards, when given
    turn_reward_ends: list[int] = field(default_factory=list)  # per turn reward: its turn's last model token in ids
    counts: Counter = field(default_factory=Counter)  # the environment's event counts, summed over its steps
    num_turns: int = 0
    num_calls: int = 0  # tool calls parsed so far (the next call's index)
    reused_tokens: int = 0  # tokens of turns 2+ the prefix cache served
    history_tokens: int = 0  # tokens turns 2+ handed the engine before their new ones (what could be reused)
    finish: str = ""  # done | max_turns | max_episode_tokens | turn_length | env_timeout | env_error
    error: str | None = None
    outcome: float | None = None  # env.episode_reward(); None: score with the run's reward functions

    @property
    def truncated(self) -> bool:
        return self.finish in TRUNCATED

    @property
    def completion_messages(self) -> list[Message]:
        return self.messages[self.num_opening :]


@dataclass
class EpisodeTiming:
    wall_s: float = 0.0
    env_s: float = 0.0  # seconds environment calls ran (on the workers, in parallel with decoding)
    idle_s: float = 0.0  # seconds the engine had nothing to decode and waited on environments


@dataclass
class _Call:
    """An environment call in flight: what it was for, and when it must have returned."""

    episode: Episode
    kind: str  # open | step | reward
    deadline: float


def turn_seed(episode_seed: int | None, turn: int) -> int | None:
    return None if episode_seed is None else (episode_seed * 1_000_003 + turn) % 2**63


class EpisodeRunner:
    """Runs a batch of episodes to their ends on one engine (see the module docstring)."""

    def __init__(
        self,
        engine: LLMEngine,
        chat: ChatTokens,
        make_env: Callable[[], Environment],
        parser: ToolCallParser,
        params: SamplingParams,
        limits: EpisodeLimits,
        workers: int,
    ) -> None:
        self.engine, self.chat, self.make_env, self.parser = engine, chat, make_env, parser
        self.params, self.limits, self.workers = params, limits, workers
        self.end_ids = engine.eos_token_ids  # end-of-turn tokens, whose text the chat template writes
        self.requests: dict[str, Episode] = {}  # engine request id -> its episode
        self.calls: dict[Future, _Call] = {}
        self.pool: EnvWorkers | None = None  # started by the first `start`, stopped by `close`
        self._parked: list[Episode] = []  # episodes whose turn `park` took out of the engine

    def run(self, rows: list[Mapping[str, Any]], seeds: list[int | None]) -> tuple[list[Episode], EpisodeTiming]:
        """One episode per (row, seed), in that order, played to their ends; the runner is closed after."""
        try:
            episodes = self.start(rows, seeds)
            return episodes, self.finish(episodes)
        finally:
            self.close()

    def start(self, rows: list[Mapping[str, Any]], seeds: list[int | None]) -> list[Episode]:
        """Open one episode per (row, seed): they advance whenever the runner is driven (`finish`), alongside
        every other episode started on it."""
        if self.pool is None:
            self.pool = EnvWorkers(self.workers)
        episodes = [Episode(row=row, seed=seed) for row, seed in zip(rows, seeds)]
        for episode in episodes:
            self._call(episode, "open", lambda e=episode: self._open(e))
        return episodes

    def finish(self, episodes: list[Episode], before_step: Callable[[], None] | None = None) -> EpisodeTiming:
        """Drive the engine and the environments until every one of `episodes` has ended; episodes started
        before or meanwhile (`before_step` may start some) advance too and stay in flight."""
        timing = EpisodeTiming()
        start, busy = time.perf_counter(), self.pool.busy_s if self.pool is not None else 0.0
        with self.engine.runner.malloc_scope():
            while not all(self._ended(episode) for episode in episodes):
                if before_step is not None:
                    before_step()
                if self.requests:
                    for output in self.engine.step():
                        self._model_turn(self.requests.pop(output.request_id), output.outputs[0], output)
                elif self.calls:
                    waited = time.perf_counter()
                    nearest = min(call.deadline for call in self.calls.values())
                    with self.engine.waiting():  # no runnable sequence: async RL lends the cores out
                        wait(list(self.calls), timeout=max(0.0, nearest - waited), return_when=FIRST_COMPLETED)
                    timing.idle_s += time.perf_counter() - waited
                else:
                    raise PosttrainError("episodes left without a turn or an environment call (parked?)")
                self._collect()
        timing.wall_s = time.perf_counter() - start
        timing.env_s = (self.pool.busy_s if self.pool is not None else 0.0) - busy
        return timing

    def _ended(self, episode: Episode) -> bool:
        """Ended, its last environment call (the reward) returned: nothing of it is in flight."""
        return bool(episode.finish) and all(call.episode is not episode for call in self.calls.values())

    def num_decoding(self) -> int:
        """Episodes with a turn in the engine or opening (their first turn next): those not waiting on a tool."""
        return len(self.requests) + sum(call.kind == "open" for call in self.calls.values())

    def park(self) -> None:
        """Take every episode's turn out of the engine (aborted, its blocks freed), so another caller can drive
        the engine alone; `unpark` asks for the same turns again (same seeds: the tokens depend on the weights
        only). A turn is only added to its episode when it finishes, so nothing of a parked turn is lost.
        Environment calls go on meanwhile."""
        for request_id, episode in self.requests.items():
            self.engine.abort_request(request_id)
            self._parked.append(episode)
        self.requests = {}

    def unpark(self) -> None:
        parked, self._parked = self._parked, []
        for episode in parked:
            self._request(episode)

    def close(self) -> None:
        """Abort what is in flight and stop the workers (a call still running finishes on its own thread)."""
        for request_id in self.requests:
            self.engine.abort_request(request_id)
        self.requests, self.calls, self._parked = {}, {}, []
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # ---- environment calls ---------------------------------------------------------------------------

    def _open(self, episode: Episode) -> list[Message]:
        episode.env = self.make_env()
        return episode.env.reset(episode.row)

    def _call(self, episode: Episode, kind: str, fn: Callable[[], Any]) -> None:
        self.calls[self.pool.submit(fn)] = _Call(episode, kind, time.perf_counter() + self.limits.step_timeout_s)

    def _collect(self) -> None:
        """Handle every call that returned, and end the episodes of calls past their deadline."""
        now = time.perf_counter()
        for future, call in list(self.calls.items()):
            if future.done():
                del self.calls[future]
                error = future.exception()
                if error is not None:
                    call.episode.error = f"{call.kind}: {type(error).__name__}: {error}"
                    call.episode.counts["env_errors"] += 1
                    self._end(call.episode, "env_error")
                elif call.kind == "open":
                    self._opened(call.episode, future.result())
                elif call.kind == "step":
                    self._stepped(call.episode, future.result())
                else:
                    call.episode.outcome = _reward_value(future.result())
            elif now > call.deadline:
                del self.calls[future]
                self.pool.abandon(future)
                call.episode.counts["env_timeouts"] += 1
                self._end(call.episode, "env_timeout")

    def _end(self, episode: Episode, finish: str) -> None:
        """Ask an episode that ended well (done) for its reward; any other end is final now."""
        episode.finish = finish
        if finish == "done":
            self._call(episode, "reward", episode.env.episode_reward)

    # ---- the episode's token sequence ----------------------------------------------------------------

    def _opened(self, episode: Episode, messages: list[Message]) -> None:
        episode.messages = list(messages)
        episode.num_opening = len(messages)
        episode.prompt_ids = self.chat.opening_ids(messages)
        if len(episode.prompt_ids) > self.limits.max_prompt_tokens:
            raise PosttrainError(
                f"an environment's opening prompt has {len(episode.prompt_ids)} tokens, more than "
                f"rollout.max_prompt_tokens={self.limits.max_prompt_tokens}; raise it"
            )
        self._request(episode)

    def _request(self, episode: Episode) -> None:
        left = self.limits.max_episode_tokens - len(episode.ids)
        params = replace(
            self.params,
            n=1,
            max_tokens=min(self.limits.max_tokens, left),
            seed=turn_seed(episode.seed, episode.num_turns),
            logprobs=True,
        )
        request_id = f"episode-{next(_request_numbers)}"
        self.requests[request_id] = episode
        self.engine.add_request(request_id, episode.prompt_ids + episode.ids, params)

    def _model_turn(self, episode: Episode, sample: Any, output: Any) -> None:
        if episode.num_turns:
            episode.reused_tokens += output.num_cached_tokens
            episode.history_tokens += len(output.prompt_token_ids)
        episode.num_turns += 1
        episode.ids += sample.token_ids
        episode.model_mask += [1] * len(sample.token_ids)
        episode.logprobs += list(sample.logprobs)
        episode.policy_versions.append(sample.policy_version if sample.policy_version is not None else -1)
        episode.token_versions += list(sample.token_policy_versions)
        if sample.finish_reason != "stop":  # no end-of-turn token: cut off by max_tokens or the episode's budget
            full = len(episode.ids) >= self.limits.max_episode_tokens
            self._end(episode, "max_episode_tokens" if full else "turn_length")
            return
        turn = self.parser(sample.text, first_call_index=episode.num_calls)
        episode.num_calls += len(turn.tool_calls)
        episode.counts["parse_failures"] += len(turn.errors)
        episode.messages.append(turn.as_message())
        self._call(episode, "step", lambda: episode.env.step(turn))

    def _stepped(self, episode: Episode, step: EnvStep) -> None:
        # The rollout counts parse failures itself (it parsed the turn); the environment's other counts add up.
        episode.counts.update({k: v for k, v in step.counts.items() if k != "parse_failures"})
        if step.reward is not None:
            episode.turn_rewards.append(float(step.reward))
            episode.turn_reward_ends.append(len(episode.ids) - 1)  # the turn's observation is not appended yet
        if step.done:
            self._end(episode, "done")
            return
        if episode.num_turns >= self.limits.max_turns:
            self._end(episode, "max_turns")
            return
        last = episode.ids[-1]  # the turn's stop token: the template's tail after it is the observation's start
        end_text = self.chat.tokenizer.decode([last], skip_special_tokens=False) if last in self.end_ids else ""
        delta = self.chat.observation_ids(episode.messages, step.observations, end_text)
        if len(episode.ids) + len(delta) >= self.limits.max_episode_tokens:  # no room left for one more token
            self._end(episode, "max_episode_tokens")
            return
        episode.messages += step.observations
        episode.ids += delta
        episode.model_mask += [0] * len(delta)
        episode.logprobs += [0.0] * len(delta)
        episode.token_versions += [episode.token_versions[-1] if episode.token_versions else -1] * len(delta)
        self._request(episode)


def _reward_value(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PosttrainError(f"episode_reward() must return a number or None, got {value!r:.60}")
    return float(value)

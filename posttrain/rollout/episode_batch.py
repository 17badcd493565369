"""Episodes as a rollout batch: G episodes per row, the same `RolloutBatch` the trainer reads for single-turn
groups, with a completion mask (1 on the model's tokens, 0 on observations) and the episodes' own rewards;
and the per-step metrics of a rollout's episodes.

The group's prompt is what its episodes share: the opening prompt when every episode of the row opens alike
(the usual case), else their longest common prefix, with the rest of each opening moved into its completion
under mask 0. The trainer's packed forward then computes that shared prefix once per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.envs import Environment
from posttrain.envs.tool_calls import ToolCallParser
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch
from posttrain.rollout.chat_tokens import ChatTokens
from posttrain.rollout.episodes import Episode, EpisodeLimits, EpisodeRunner, EpisodeTiming
from posttrain.rollout.generate import EngineCall

TruncatedReward = Literal["zero", "unscorable"]
TurnRewards = Literal["ignore", "sum", "per_turn"]


@dataclass(frozen=True)
class EpisodeOptions:
    """How a run plays and scores its episodes (the RL config's `env:` section, resolved)."""

    make_env: Callable[[], Environment]
    parser: ToolCallParser
    chat: ChatTokens
    limits: EpisodeLimits
    workers: int
    truncated_reward: TruncatedReward = "zero"
    turn_rewards: TurnRewards = "ignore"


@dataclass
class EpisodeLog:
    """The episodes a step played (every round of it) and their time, for the step's metrics."""

    episodes: list[Episode] = field(default_factory=list)
    timing: EpisodeTiming = field(default_factory=EpisodeTiming)

    def add(self, episodes: list[Episode], timing: EpisodeTiming) -> None:
        self.episodes += episodes
        for name in ("wall_s", "env_s", "idle_s"):
            setattr(self.timing, name, getattr(self.timing, name) + getattr(timing, name))


class EpisodeGroups:
    """Plays G = params.n episodes of each row: a drop-in for `generate_groups` in `collect_rollout`.

    Seeds: episode j of row i is seeded seeds[i] + j (its turns from that, see episodes.turn_seed); without
    `seeds`, one base seed is drawn from torch's generator per call (restored on resume, as the single-turn
    path's unseeded sampling is), so the episodes never depend on thread timing."""

    def __init__(self, options: EpisodeOptions) -> None:
        self.options = options
        self.log = EpisodeLog()

    def __call__(
        self,
        llm: LLM,
        rows: list[dict[str, Any]],
        params: SamplingParams,
        seeds: list[int] | None = None,
        lockstep: EngineCall = nullcontext,
    ) -> RolloutBatch:
        G = params.n
        if seeds is None and params.temperature == 0:
            seeds = [0] * len(rows)  # greedy: the seed changes nothing; torch's generator is left alone
        elif seeds is None:
            base = int(torch.randint(0, 2**62, ()))
            seeds = [base + i * G for i in range(len(rows))]
        o = self.options
        runner = EpisodeRunner(llm.engine, o.chat, o.make_env, o.parser, params, o.limits, o.workers)
        with lockstep():
            episodes, timing = runner.run(*each_episode(rows, seeds, G))
        return self.played(episodes, timing, G)

    def played(self, episodes: list[Episode], timing: EpisodeTiming, G: int) -> RolloutBatch:
        """G consecutive episodes per row, played: logged for the step's metrics, and their batch."""
        self.log.add(episodes, timing)
        o = self.options
        return episodes_to_batch(episodes, G, o.chat, o.truncated_reward, o.turn_rewards)

    def take_log(self) -> EpisodeLog:
        log, self.log = self.log, EpisodeLog()
        return log


def each_episode(rows: list[Any], seeds: list[int], G: int) -> tuple[list[Any], list[int]]:
    """(row, seed) per episode: G episodes of each row, episode j of row i seeded seeds[i] + j."""
    return [row for row in rows for _ in range(G)], [seed + j for seed in seeds for j in range(G)]


def _common_prefix(sequences: list[list[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n


def episode_reward(episode: Episode, truncated_reward: TruncatedReward) -> float | None:
    """The reward an episode sets for itself (NaN: unscorable), or None: the reward functions score it."""
    if episode.finish == "env_error":
        return math.nan
    if episode.truncated:
        return 0.0 if truncated_reward == "zero" else math.nan
    return episode.outcome


def episodes_to_batch(
    episodes: list[Episode], G: int, chat: ChatTokens, truncated_reward: TruncatedReward, turn_rewards: TurnRewards
) -> RolloutBatch:
    """G consecutive episodes per group (see the module docstring)."""
    prompt_ids, rows = [], []
    completion_ids, masks, logprobs, token_versions, token_rewards = [], [], [], [], []
    for g in range(len(episodes) // G):
        group = episodes[g * G : (g + 1) * G]
        shared = _common_prefix([e.prompt_ids for e in group])
        prompt_ids.append(group[0].prompt_ids[:shared])
        rows.append({**group[0].row, PROMPT_KEY: group[0].messages[: group[0].num_opening]})
        for e in group:
            own = e.prompt_ids[shared:]  # the part of this opening its siblings do not share: never trained
            completion_ids.append(own + e.ids)
            masks.append([0] * len(own) + e.model_mask)
            logprobs.append([0.0] * len(own) + e.logprobs)
            first = e.token_versions[0] if e.token_versions else min(e.policy_versions, default=-1)
            token_versions.append([first] * len(own) + e.token_versions)
            token_rewards.append(_placed_turn_rewards(e, len(own)))
    return RolloutBatch(
        group_size=G,
        rows=rows,
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        texts=[chat.tokenizer.decode(e.ids, skip_special_tokens=False) for e in episodes],
        rollout_logprobs=logprobs,
        finish_reasons=["length" if e.truncated else "stop" for e in episodes],
        policy_versions=[min(e.policy_versions, default=-1) for e in episodes],
        token_versions=token_versions,
        completion_mask=masks,
        completion_messages=[e.completion_messages for e in episodes],
        env_rewards=[episode_reward(e, truncated_reward) for e in episodes],
        turn_rewards=[sum(e.turn_rewards) for e in episodes] if turn_rewards == "sum" else None,
        token_rewards=token_rewards if turn_rewards == "per_turn" else None,
    )


def _placed_turn_rewards(episode: Episode, offset: int) -> list[float]:
    """Per completion token: each of the episode's per-turn rewards on the last model token of the turn that earned
    it, 0 elsewhere; `offset`: the opening tokens moved into the completion before the episode's own."""
    placed = [0.0] * (offset + len(episode.ids))
    for end, reward in zip(episode.turn_reward_ends, episode.turn_rewards, strict=True):
        placed[offset + end] += reward
    return placed


def episode_metrics(log: EpisodeLog) -> dict[str, Any]:
    """Per-episode means (turns, tool calls in all and by tool, tool errors and timeouts, parse failures, model
    and observation tokens), the truncated share, the environments' share of the rollout's time and what the
    prefix cache served on turns 2+. Means, so that torchrun's ranks average them."""
    episodes = log.episodes
    if not episodes:
        return {}
    n = len(episodes)
    totals: dict[str, float] = {}
    for episode in episodes:
        for key, value in episode.counts.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    model = sum(sum(e.model_mask) for e in episodes)
    history = sum(e.history_tokens for e in episodes)
    out: dict[str, Any] = {
        "env/turns": sum(e.num_turns for e in episodes) / n,
        "env/truncated_frac": sum(e.truncated for e in episodes) / n,
        "env/tokens_model": model / n,
        "env/tokens_observation": (sum(len(e.ids) for e in episodes) - model) / n,
        "env/time_share": log.timing.env_s / max(log.timing.wall_s, 1e-9),
        "env/idle_share": log.timing.idle_s / max(log.timing.wall_s, 1e-9),
        "prefix_cache/reused_tokens": sum(e.reused_tokens for e in episodes) / n,
        "prefix_cache/reused_frac": sum(e.reused_tokens for e in episodes) / history if history else math.nan,
    }
    for key in ("tool_calls", "tool_errors", "tool_timeouts", "parse_failures", "env_timeouts", "env_errors"):
        totals.setdefault(key, 0.0)
    out.update({f"env/{key}": value / n for key, value in sorted(totals.items())})
    for finish in sorted({e.finish for e in episodes}):
        out[f"env/finish/{finish}"] = sum(e.finish == finish for e in episodes) / n
    errors = [e.error for e in episodes if e.error]
    if errors:
        out["env/error"] = errors[0][:200]
    return out

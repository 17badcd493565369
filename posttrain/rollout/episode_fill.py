"""The tail fill for multi-turn episodes (async RL in one process, `rollout.async_fill` with an `env:` section).

A step's episodes wait on their environments together: every episode calls its tool after its first turn, so for
the tool's latency the engine has nothing to decode (a sandbox, a search API or a judge answering in seconds). The
update may use the cores meanwhile, but when the rollout is the longer side (a 2-core CPU: it is), that wait stays
on its critical path. `EpisodeFill` starts the next step's episodes in the same `EpisodeRunner` once at most
`fraction` of one step's episodes have a turn generating (over every step in flight; the rest wait on tools, or
ended) and the staleness bound lets the rollout start that step (`may_start`): their first turns decode while the
current step's episodes wait, and they stay in flight when the current step's batch is handed over, to be finished
by a later step's collection. The bound decides how many steps are in flight: the current one and up to
`lead` (the producer's steps ahead of the update) after it.

What stays as without the fill (as with `rollout.tail_fill.TailFill`, whose contract this follows):
- the prompts: step s + 1's are drawn when its episodes start, after all of step s's draws, in the same order
  (the fill is off with DAPO dynamic sampling, whose refill rounds would draw later);
- the seeds: episode j of prompt p of step s + 1 is seeded `seed_base(s + 1) + p * n + j`, whenever it starts,
  and each turn from that (episodes.turn_seed), so its tokens depend only on the weights they are drawn under;
- the bound: step s + 1 starts only when the producer would start it, every token records its version, and the
  trainer still checks each sample against `rollout.max_staleness`.
The engine to the trainer alone (held-out evaluation, stale refills): `parked()` takes the in-flight turns out of
the engine and asks for them again after (same seeds), while the environments' calls go on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from posttrain.engine import LLM, SamplingParams
from posttrain.rollout.batch import RolloutBatch
from posttrain.rollout.episode_batch import EpisodeGroups, each_episode
from posttrain.rollout.episodes import Episode, EpisodeRunner
from posttrain.rollout.generate import EngineCall
from posttrain.rollout.tail_fill import FillLog, FillPlan


@dataclass
class AdmittedEpisodes:
    """A step's first round, started ahead: its rows (the step's first draws) and their episodes, G per row."""

    step: int
    rows: list[dict[str, Any]]
    episodes: list[Episode]
    unfinished_before: int  # episodes (of any step) with a turn generating when this was started
    fill: EpisodeFill = field(repr=False)

    def finish(self, params: SamplingParams, lockstep: EngineCall = nullcontext) -> RolloutBatch:
        """The round's batch: drives the runner until its episodes end (the next step's fill goes on meanwhile)."""
        return self.fill.finish(self.episodes, params, lockstep)


class EpisodeFill:
    """Plays the rollout thread's episodes on one persistent runner (a `GroupGenerator` for `collect_rollout`, plus
    `take` for a step's admitted round) and starts the next steps' episodes while this step's wait on tools, as
    `plan` says (its `fraction` counted in episodes with a turn generating). `groups`: the run's `EpisodeGroups`
    (its options, and the log the step's metrics read)."""

    def __init__(self, groups: EpisodeGroups, llm: LLM, plan: FillPlan) -> None:
        o = groups.options
        self.groups, self.plan, self.params = groups, plan, plan.params
        self.runner = EpisodeRunner(llm.engine, o.chat, o.make_env, o.parser, plan.params, o.limits, o.workers)
        self.log = FillLog()
        self._ahead: dict[int, AdmittedEpisodes] = {}
        self._step = 0  # the step being collected
        self._current: list[Episode] = []  # its episodes being driven now

    def take(self, step: int) -> AdmittedEpisodes | None:
        """Step `step`'s collection begins: its first round if it was started ahead, else None."""
        self._step = step
        admitted = self._ahead.pop(step, None)
        self._current = []
        return admitted

    def __call__(
        self,
        llm: LLM,
        rows: list[dict[str, Any]],
        params: SamplingParams,
        seeds: list[int] | None = None,
        lockstep: EngineCall = nullcontext,
    ) -> RolloutBatch:
        """EpisodeGroups' call (G = params.n episodes of each row; `seeds` per row, as collect_rollout gives them),
        with the next step's episodes started in this round's tail."""
        if seeds is None:
            raise ValueError("the episode fill needs seeded prompts (async mode seeds every prompt)")
        return self.finish(self._start(rows, seeds), params, lockstep)

    def finish(
        self, episodes: list[Episode], params: SamplingParams, lockstep: EngineCall = nullcontext
    ) -> RolloutBatch:
        if params != self.params:
            raise ValueError("the episode fill plays every round with the run's sampling parameters")
        self._current = episodes
        with lockstep():
            timing = self.runner.finish(episodes, before_step=self.maybe_fill)
        return self.groups.played(episodes, timing, params.n)

    def _start(self, rows: list[dict[str, Any]], seeds: list[int]) -> list[Episode]:
        return self.runner.start(*each_episode(rows, seeds, self.params.n))

    def maybe_fill(self) -> None:
        """Before each engine step of a step's collection: start the next step not started yet when at most
        `fraction` of one step's episodes have a turn generating (over every step in flight) and the bound lets
        the rollout start it. With a bound of k steps ahead, up to k steps after the current one are in flight."""
        plan = self.plan
        following = max(self._step, *self._ahead) + 1 if self._ahead else self._step + 1
        if following > plan.last_step or not self._current:
            return
        generating = self.runner.num_decoding()  # with a turn in the engine or opening, whichever step they are of
        if generating > plan.fraction * len(self._current) or not plan.may_start(following):
            return
        rows, seeds = plan.first_round(following)
        self._ahead[following] = AdmittedEpisodes(following, rows, self._start(rows, seeds), generating, self)
        self.log.steps.append(following)
        self.log.unfinished_before.append(generating)

    @contextmanager
    def parked(self) -> Iterator[None]:
        """The engine free of this fill's turns for another caller (see the module docstring)."""
        self.runner.park()
        try:
            yield
        finally:
            self.runner.unpark()

    def close(self) -> None:
        """Drop the episodes started ahead that no collection took (the run ended first) and stop the workers."""
        self._ahead.clear()
        self.runner.close()

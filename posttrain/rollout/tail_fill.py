"""Filling the tail of a step's rollout with the next step's prompts (async RL in one process, `rollout.async_fill`).

One engine call per step ends in a tail: the last few long samples decode at a tiny batch while the cores that a full
batch would use sit idle (on a CPU a decode step at batch 4 costs nearly what one at batch 64 does: the weights are
read either way). When the staleness bound lets the rollout start step s + 1 already (the producer's lead >= 1),
`TailFill` submits step s + 1's first round into the same engine once at most `fraction` of step s's samples are
still generating, so the engine keeps a full batch. Each step's outputs are collected by request id
(`LLM.submit` / `LLM.collect`): step s's batch holds exactly step s's prompts, and step s + 1's requests, once
submitted, decode along and are collected when step s + 1's collection begins.

What stays as without the fill:
- the prompts: step s + 1's are drawn when its requests are submitted, after all of step s's draws (the fill is off
  with DAPO dynamic sampling, whose refill rounds would draw later), in the same order;
- the seeds: prompt p of step s + 1 gets `seed_base(s + 1) + p * n`, whenever it is admitted; a seeded sample's
  draws depend only on its logits (engine/sampler.py), i.e. on the weights it is decoded under;
- the bound: step s + 1 is submitted only when the producer would start it (`may_start`), so its tokens are drawn
  at versions the bound allows, and every token records its version as before; the trainer still checks.
What changes with k >= 1: a sample admitted early is decoded under the weights of that moment (older, within the
bound) and in another batch; with k = 0 the producer never lets step s + 1 start during step s, so nothing changes.

Multi-turn episodes step the engine themselves, turn by turn: their fill is `rollout.episode_fill.EpisodeFill`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from posttrain.engine import LLM, SamplingParams
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch
from posttrain.rollout.generate import EngineCall, groups_batch, seeded_params


@dataclass
class AdmittedRound:
    """A step's first round, drawn and submitted ahead: its rows (the step's first draws) and their request ids."""

    step: int
    rows: list[dict[str, Any]]
    request_ids: list[str]
    unfinished_before: int  # samples of the step being collected still generating when this was submitted
    fill: TailFill = field(repr=False)

    def finish(self, params: SamplingParams, lockstep: EngineCall = nullcontext) -> RolloutBatch:
        """The round's batch: steps the engine until its requests finish (the next step's fill goes on meanwhile)."""
        with lockstep():
            outputs = self.fill.llm.collect(self.request_ids, before_step=self.fill.maybe_fill)
        return groups_batch(self.rows, params, outputs)


@dataclass
class FillLog:
    """Every round submitted ahead, in order: its step, and how many samples of the step being collected were still
    generating then (ints only: a long run keeps one pair per step)."""

    steps: list[int] = field(default_factory=list)
    unfinished_before: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FillPlan:
    """What a fill (this module's `TailFill`, rollout/episode_fill.py's `EpisodeFill`) needs to start a later step
    ahead: `draw(step, n)`: step `step`'s first n prompts (the prompt source's draw, with its checkpoint
    bookkeeping); `seed_base(step)`: the seed of the step's first prompt; `may_start(step)`: whether the staleness
    bound lets the rollout start `step` now; `fraction`: start once at most this share of the current step's
    samples are still generating (1: at once, 0.5: when half have finished)."""

    params: SamplingParams
    num_prompts: int
    draw: Callable[[int, int], list[dict[str, Any]]]
    seed_base: Callable[[int], int]
    may_start: Callable[[int], bool]
    last_step: int
    fraction: float

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")

    def first_round(self, step: int) -> tuple[list[dict[str, Any]], list[int]]:
        """Step `step`'s first round drawn now: its rows and their seeds, as collect_rollout seeds a step's first
        round (prompt p: seed_base(step) + p * n)."""
        rows = self.draw(step, self.num_prompts)
        base, n = self.seed_base(step), self.params.n
        return rows, [base + place * n for place in range(len(rows))]


class TailFill:
    """Drives the rollout thread's engine calls (a `GroupGenerator` for `collect_rollout`, plus `take` for a step's
    admitted round) and submits the next step's first round into the current step's tail, as `plan` says."""

    def __init__(self, llm: LLM, plan: FillPlan) -> None:
        self.llm, self.plan, self.params = llm, plan, plan.params
        self.log = FillLog()
        self._ahead: dict[int, AdmittedRound] = {}
        self._step = 0  # the step being collected
        self._current: list[str] = []  # its requests in the engine now

    def take(self, step: int) -> AdmittedRound | None:
        """Step `step`'s collection begins: its first round if it was submitted ahead, else None."""
        self._step = step
        admitted = self._ahead.pop(step, None)
        self._current = list(admitted.request_ids) if admitted is not None else []
        return admitted

    def __call__(
        self,
        llm: LLM,
        rows: list[dict[str, Any]],
        params: SamplingParams,
        seeds: list[int] | None = None,
        lockstep: EngineCall = nullcontext,
    ) -> RolloutBatch:
        """generate_groups, with the next step's first round submitted into this call's tail."""
        with lockstep():
            ids = llm.submit([row[PROMPT_KEY] for row in rows], seeded_params(params, seeds))
            self._current = ids
            outputs = llm.collect(ids, before_step=self.maybe_fill)
        return groups_batch(rows, params, outputs)

    def maybe_fill(self) -> None:
        """Before each engine step of the current step's collection: submit the next step's first round when the
        current step's tail is short enough and the bound lets the rollout start it."""
        following, plan = self._step + 1, self.plan
        if following in self._ahead or following > plan.last_step or not self._current:
            return
        engine = self.llm.engine
        unfinished = sum(engine.num_unfinished_samples(i) for i in self._current)
        if unfinished > plan.fraction * len(self._current) * self.params.n or not plan.may_start(following):
            return
        rows, seeds = plan.first_round(following)
        ids = self.llm.submit([row[PROMPT_KEY] for row in rows], seeded_params(self.params, seeds))
        self._ahead[following] = AdmittedRound(following, rows, ids, unfinished, self)
        self.log.steps.append(following)
        self.log.unfinished_before.append(unfinished)

    def parked(self) -> AbstractContextManager:
        """Nothing to set aside while another caller drives the engine: `LLM.collect` keeps the outputs of requests
        it did not submit for their own collect."""
        return nullcontext()

    def close(self) -> None:
        """Drop the rounds submitted ahead that no collection took (the run ended first)."""
        for admitted in self._ahead.values():
            self.llm.abort(admitted.request_ids)
        self._ahead.clear()

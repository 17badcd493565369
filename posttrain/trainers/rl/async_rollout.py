"""Asynchronous rollouts in one process (`rollout.mode: async`): the engine collects the next step(s) in its own
thread (`rollout.producer.ThreadedProducer`) while the update runs on the same module.

The trainer side, per step: take the batch collected for the step, split off the groups with a sample older than
`rollout.max_staleness` versions (`rollout.staleness`), regenerate those groups now (the engine to the trainer
alone, at the current weights, seeded from the step), and report the staleness histogram, the drops and the share
of wall time each side was busy. After the update, tell the producer it may go on.

Threads (rollout/core_share.py): torch's intra-op thread count is per thread. While both sides are busy each runs
`rollout.async_threads` (default: half of torch's threads, at least 1; with two cores, one each); while one side
waits (the update for a batch, the rollout at the staleness bound) the other runs all of them. The rollout thread
sets its count before every engine step, the update before every micro-batch and at every tensor its forward saves
for the backward and the backward reads (CoreShare.autograd_claims). The count is restored at the end.

Determinism and resume: every prompt is seeded from (train.seed, step, its place), as rollout.seed_prompts does,
so a step's samples depend on the weights they are drawn under and on nothing else (not on thread timing). With
k = 0 the weights are those of the previous step, as in sync mode: the run is the sync run. With k >= 1 the
versions tokens are drawn under depend on how the two sides interleave, as in every asynchronous RL stack. In-flight
samples are not saved: a checkpoint keeps the prompt source as it was before the first step not yet trained
(`StepPrompts`), and a resumed run collects that step again, from the same prompts and seeds, at the checkpoint's
weights (so its first step is the one a k = 0 run would take from that checkpoint, whatever k).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rollout.batch import RolloutBatch, concat_batches
from posttrain.rollout.collect import prompt_seed_base
from posttrain.rollout.core_share import CoreShare
from posttrain.rollout.episode_fill import EpisodeFill
from posttrain.rollout.generate import generate_groups
from posttrain.rollout.producer import ProducedBatch, ThreadedProducer
from posttrain.rollout.prompts import PromptSource
from posttrain.rollout.scoring import score_groups
from posttrain.rollout.staleness import split_stale, staleness_metrics
from posttrain.rollout.tail_fill import FillPlan, TailFill
from posttrain.trainers.rl.config import RLConfig, batch_sizes

REFILL_SEED_OFFSET = 1 << 23  # refill seeds of a step: past its prompts' (collect.prompt_seed_base)
logger = logging.getLogger("posttrain.trainers")


def updates_per_step(cfg: RLConfig) -> int:
    """Optimizer steps (policy versions) per RL step: epochs x minibatches."""
    batch, minibatch, _ = batch_sizes(cfg)
    return cfg.train.epochs * (batch // minibatch)


def lead_steps(cfg: RLConfig) -> int:
    """How many steps the rollout may run ahead of the update: max_staleness // updates_per_step."""
    return cfg.rollout.max_staleness // updates_per_step(cfg)


def check_async(cfg: RLConfig, world: int) -> None:
    """The in-process asynchronous mode runs one process; ConfigError otherwise."""
    if cfg.rollout.mode == "async" and world > 1:
        raise ConfigError(
            f"rollout.mode=async runs the rollout in a thread of one process; this run has {world} processes "
            "(torchrun): run it as one process, or rollout.mode=sync"
        )


class StepPrompts:
    """A prompt source whose checkpoint state is where it stood before the first step not yet trained, although
    the rollout thread has drawn the prompts of later steps already (a resumed run draws them again)."""

    def __init__(self, source: PromptSource) -> None:
        self.source = source
        self.reward = getattr(source, "reward", "")
        self._before: dict[int, dict[str, Any]] = {}  # step -> the source's state before its first draw
        self._next_step = 1  # the first step not yet trained
        self._lock = threading.Lock()

    def begin_step(self, step: int) -> None:
        """Before the step's first draw (once: the tail fill may have begun it during the previous step)."""
        with self._lock:
            if step not in self._before:
                self._before[step] = copy.deepcopy(self.source.state_dict())

    def trained(self, step: int) -> None:
        with self._lock:
            self._next_step = step + 1
            for old in [s for s in self._before if s <= step]:
                del self._before[old]

    def sample(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.source.sample(n)

    def held_out(self, n: int) -> list[dict[str, Any]]:
        return self.source.held_out(n)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            before = self._before.get(self._next_step)
            return copy.deepcopy(before) if before is not None else self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.source.load_state_dict(state)
            self._before.clear()


class StepConsumer:
    """The trainer's side of a rollout producer (`rollout.producer`), in one process or beside rollout processes:
    take each step's batch within the staleness bound (stale groups regenerated now, on the trainer's engine), tell
    the producer when the update is done, and the async/* metrics (staleness, drops, busy and idle shares)."""

    def __init__(self, run: Any, producer: Any, max_staleness: int) -> None:
        self.run = run
        self.producer = producer
        self.max_staleness = max_staleness
        self.waited_s = 0.0  # the update side waiting for a batch since the last step's metrics
        self.mark = time.perf_counter()
        self.busy_mark = 0.0

    def take(self, step: int) -> tuple[ProducedBatch, dict[str, float]]:
        """The step's batch with its stale groups regenerated, and the async/* metrics."""
        waited = time.perf_counter()
        produced = self.producer.get(step)
        self.waited_s += time.perf_counter() - waited
        if produced.batch is None:
            return produced, {}
        run, k = self.run, self.max_staleness
        split = split_stale(produced.batch, run.llm.policy_version, k)
        used = split.used_staleness
        if split.stale_groups:
            fresh = produced.batch.select_groups(split.fresh_groups)
            with self.producer.exclusive():
                refill = regenerate_groups(run, step, produced.batch.select_groups(split.stale_groups))
            produced.batch = concat_batches([b for b in (fresh, refill) if b.num_groups])
            used = used + [0] * refill.num_samples
        dropped = len(split.stale_groups) * produced.batch.group_size
        return produced, staleness_metrics(used, k, dropped)

    def claim_cores(self) -> None:
        """Before each micro-batch of the update: take the share of the cores the rollout side leaves (in one
        process; rollout processes have cores of their own)."""

    def update_claims(self) -> AbstractContextManager:
        """Around the update: claims within its forwards and backwards (one process only)."""
        return nullcontext()

    def step_done(self, step: int) -> dict[str, float]:
        """Let the producer go on past `step`; the share of wall time each side was busy since the last call."""
        self.producer.update_done(step)
        now = time.perf_counter()
        wall = max(now - self.mark, 1e-9)
        busy = self.producer.timing().busy_s
        rollout_busy = min((busy - self.busy_mark) / wall, 1.0)
        update_busy = max(1.0 - self.waited_s / wall, 0.0)
        self.mark, self.busy_mark, self.waited_s = now, busy, 0.0
        return {
            "async/rollout_busy_frac": rollout_busy,
            "async/rollout_idle_frac": 1.0 - rollout_busy,
            "async/update_busy_frac": update_busy,
            "async/update_idle_frac": 1.0 - update_busy,
        }

    def close(self) -> None:
        self.producer.close()


class AsyncRollout(StepConsumer):
    """The in-process producer of a run in async mode (a rollout thread) and the cores the two sides share."""

    def __init__(self, run: Any, first_step: int, collect: Any) -> None:
        cfg = run.cfg
        self.threads_before = torch.get_num_threads()
        share = cfg.rollout.async_threads or max(1, self.threads_before // 2)
        self.cores = CoreShare(total=max(self.threads_before, share), share=share)
        self.cores.register("update")
        updates, k = updates_per_step(cfg), cfg.rollout.max_staleness
        if 0 < k < updates:
            logger.warning(
                "posttrain: rollout.max_staleness=%d is less than the %d optimizer steps (policy versions) of one RL "
                "step, so the rollout cannot run ahead of the update; rollout.max_staleness=%d overlaps one step",
                k,
                updates,
                updates,
            )
        self.fill = tail_fill(run, lead_steps(cfg), self._may_start)
        run.llm.engine.before_step.append(self.cores.claim)  # the rollout thread's count, per engine step
        run.llm.engine.waiting = self.cores.waiting  # scoring, episodes waiting on environments: the side is idle
        producer = ThreadedProducer(
            lambda step: collect(step, self.fill),
            first_step=first_step,
            last_step=cfg.train.max_steps,
            lead=lead_steps(cfg),
            timeout_s=cfg.rollout.async_timeout_s,
            cores=self.cores,
            start=False,
            hold=self.fill.parked if self.fill is not None else None,
        )
        super().__init__(run, producer, k)
        producer.start()  # the tail fill asks self.producer whether the bound lets the next step start

    def _may_start(self, step: int) -> bool:
        return self.producer.may_start(step)

    def take(self, step: int) -> tuple[ProducedBatch, dict[str, float]]:
        self.cores.busy("update", False)  # waiting for the batch: the rollout may take every core
        try:
            return super().take(step)
        finally:
            self.cores.busy("update", True)
            self.cores.claim()

    def claim_cores(self) -> None:
        self.cores.claim()

    def update_claims(self) -> AbstractContextManager:
        return self.cores.autograd_claims()

    def step_done(self, step: int) -> dict[str, float]:
        metrics = super().step_done(step)
        if isinstance(self.run.source, StepPrompts):
            self.run.source.trained(step)
        return metrics

    def close(self) -> None:
        super().close()
        if self.fill is not None:
            self.fill.close()
        hooks = self.run.llm.engine.before_step
        if self.cores.claim in hooks:
            hooks.remove(self.cores.claim)
        if self.run.llm.engine.waiting == self.cores.waiting:
            self.run.llm.engine.waiting = nullcontext
        torch.set_num_threads(self.threads_before)


def tail_fill(run: Any, lead: int, may_start: Callable[[int], bool]) -> TailFill | EpisodeFill | None:
    """The run's tail fill: `TailFill` (rollout/tail_fill.py) for single-turn prompts, `EpisodeFill`
    (rollout/episode_fill.py) for episodes; None where it is off: `rollout.async_fill` 0, a rollout that cannot
    run ahead (lead 0, e.g. k = 0), or DAPO dynamic sampling (its refills draw after the fill)."""
    cfg = run.cfg
    if cfg.rollout.async_fill == 0 or lead == 0 or run.algo.dynamic_sampling:
        return None

    def draw(step: int, n: int) -> list[dict[str, Any]]:
        if isinstance(run.source, StepPrompts):
            run.source.begin_step(step)
        return run.source.sample(n)

    plan = FillPlan(
        run.params,
        cfg.rollout.prompts_per_step,
        draw,
        lambda step: prompt_seed_base(cfg.train.seed, step),
        may_start,
        last_step=cfg.train.max_steps,
        fraction=cfg.rollout.async_fill,
    )
    return EpisodeFill(run.episodes, run.llm, plan) if run.episodes is not None else TailFill(run.llm, plan)


def regenerate_groups(run: Any, step: int, stale: RolloutBatch) -> RolloutBatch:
    """The stale groups' rows sampled again now, at the current weights, seeded from the step (refill seeds), and
    scored. The caller holds the engine (`producer.exclusive()`)."""
    cfg, n = run.cfg, run.params.n
    base = prompt_seed_base(cfg.train.seed, step) + REFILL_SEED_OFFSET
    seeds = [base + g * n for g in range(stale.num_groups)]
    generate = run.episodes or generate_groups
    batch = generate(run.llm, stale.rows, run.params, seeds)
    return score_groups(batch, run.specs, run.overlong)

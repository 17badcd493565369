"""Collecting the step's rollout batch: draw prompts, generate their groups, score them; with DAPO dynamic
sampling, drop groups whose task rewards are all equal and sample more prompts to refill the batch, a
bounded number of rounds (data-parallel: the ranks decide on the global set of groups)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.env import all_gather_objects
from posttrain.engine import LLM, SamplingParams
from posttrain.rewards import RewardSpec
from posttrain.rollout.batch import RolloutBatch, concat_batches
from posttrain.rollout.generate import EngineCall, GroupGenerator, generate_groups
from posttrain.rollout.prompts import PromptSource
from posttrain.rollout.scoring import OverlongShaping, score_groups, zero_variance_groups
from posttrain.rollout.tail_fill import AdmittedRound


@dataclass
class RolloutStats:
    rollout_s: float = 0.0
    reward_s: float = 0.0
    generated_tokens: int = 0
    zero_variance_frac: float = 0.0  # of the first round's groups: those dynamic sampling drops
    refill_rounds: int = 0
    extra_prompts: int = 0  # prompts sampled beyond prompts_per_step to refill
    dropped_groups: int = 0


def prompt_seed_base(seed: int, step: int) -> int:
    """The seed of the step's first prompt with rollout.seed_prompts (see collect_rollout); steps stay apart
    by 2**24 seeds (prompts x samples of a step)."""
    return (seed * 1_000_003 + step) << 24


def collect_rollout(
    llm: LLM,
    source: PromptSource,
    num_prompts: int,
    params: SamplingParams,
    specs: list[RewardSpec],
    overlong: OverlongShaping | None,
    dynamic_sampling: bool,
    max_refill_rounds: int,
    shard: Callable[[list[Any]], list[Any]] | None = None,
    seed_base: int | None = None,
    lockstep: EngineCall = nullcontext,
    generate: GroupGenerator = generate_groups,
    admitted: AdmittedRound | None = None,
) -> tuple[RolloutBatch | None, RolloutStats]:
    """The step's scored batch. With dynamic sampling, only groups whose task rewards differ are kept
    (correctness, not the length-shaped reward: see zero_variance_groups) and up to `max_refill_rounds`
    extra rollouts refill the batch to `num_prompts` groups; fewer may be returned, and None when no
    group is left.

    Data-parallel: every rank draws the same `num_prompts` prompts and `shard` keeps this rank's (whole
    groups: a prompt's samples stay on one rank). `seed_base`: the prompt at place p of the step's draws
    is seeded with seed_base + p * n (the engine seeds sample i with seed + i), so a prompt gets the same
    samples whichever rank, and whichever batch, it lands in.

    Dynamic sampling under data parallelism decides on the global set of groups, as one process does: the
    ranks all-gather which of their groups they keep, so every rank refills the same rounds; at the end they
    all-gather their kept groups, take the first `num_prompts` by place (the single process's batch) and deal
    them out strided again. A batch left short of `num_prompts` loses its last (count mod world size)
    groups, so that every rank trains on the same number of groups. `lockstep`: see generate_groups.
    `generate`: generate_groups, or an `EpisodeGroups` (multi-turn episodes, each group's G of a row), or a
    `TailFill`. `admitted`: the step's first round, drawn and submitted ahead by that `TailFill` (its rows are the
    step's first `num_prompts` draws, seeded as seed_base says): its batch is collected instead of drawn anew."""
    if admitted is not None and (shard is not None or dynamic_sampling):
        raise ValueError("a round submitted ahead (tail fill) needs one process and no dynamic sampling")
    stats = RolloutStats()
    drawn = 0  # prompts drawn this step, over all ranks: the place of the next one
    placed: list[int] = []  # the place of each group of this rank's last round

    def one_round(n: int) -> RolloutBatch:
        nonlocal drawn, placed
        start = time.perf_counter()
        if admitted is not None and drawn == 0:  # drawn and submitted during the previous step's tail
            placed = list(range(n))
            drawn += n
            batch = admitted.finish(params, lockstep)
        else:
            places = list(enumerate(source.sample(n), start=drawn))  # (place in the step, row)
            drawn += n
            if shard is not None:
                places = shard(places)
            placed = [place for place, _ in places]
            seeds = [seed_base + place * params.n for place, _ in places] if seed_base is not None else None
            batch = generate(llm, [row for _, row in places], params, seeds, lockstep=lockstep)
        stats.rollout_s += time.perf_counter() - start
        stats.generated_tokens += sum(len(ids) for ids in batch.completion_ids)
        start = time.perf_counter()
        with llm.engine.waiting():  # no engine step until the rewards are in: async RL lends the cores out
            batch = score_groups(batch, specs, overlong)
        stats.reward_s += time.perf_counter() - start
        return batch

    batch = one_round(num_prompts)
    zero_var = zero_variance_groups(batch)
    stats.zero_variance_frac = float(zero_var.float().mean())
    if not dynamic_sampling:
        return batch, stats
    kept: list[RolloutBatch] = []
    kept_places: list[int] = []  # the place of each group of `kept`, in order
    have = 0  # groups kept so far, over every rank

    def keep(round_batch: RolloutBatch, zero: torch.Tensor) -> None:
        nonlocal have
        groups = [g for g in range(round_batch.num_groups) if not zero[g]]
        kept.append(round_batch.select_groups(groups))
        kept_places.extend(placed[g] for g in groups)
        # (kept, dropped) summed over the ranks: every rank then takes the same refill decisions.
        mine = (len(groups), int(zero.sum()))
        counts = all_gather_objects(mine) if shard is not None else [mine]
        have += sum(c[0] for c in counts)
        stats.dropped_groups += sum(c[1] for c in counts)

    keep(batch, zero_var)
    while have < num_prompts and stats.refill_rounds < max_refill_rounds:
        keep_rate = max(have / (num_prompts + stats.extra_prompts), 0.25)  # sample extra for the expected drop
        n = min(num_prompts, math.ceil((num_prompts - have) / keep_rate))
        stats.refill_rounds += 1
        stats.extra_prompts += n
        extra = one_round(n)
        keep(extra, zero_variance_groups(extra))
    kept = [b for b in kept if b.num_groups]
    merged = concat_batches(kept) if kept else None
    if shard is None:
        if merged is None:
            return None, stats
        return merged.select_groups(list(range(min(num_prompts, merged.num_groups)))), stats
    # Every rank's kept groups, ordered by place: the single process's kept batch; its first num_prompts.
    ranks = all_gather_objects((merged, kept_places))
    gathered = [
        (place, rank_batch, g)
        for rank_batch, places in ranks
        if rank_batch is not None
        for g, place in enumerate(places)
    ]
    gathered.sort(key=lambda item: item[0])  # (place, the rank's kept batch, the group's index in it)
    take = min(num_prompts, len(gathered))
    take -= take % len(ranks)  # the same number of whole groups on every rank
    mine = shard(gathered[:take])
    if not mine:
        return None, stats
    return concat_batches([b.select_groups([g]) for _, b, g in mine]), stats

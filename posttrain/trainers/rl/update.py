"""The update half of an RL step: the step's samples as tensors and packed micro-batches (packed once), the
no-grad scoring passes (reference, pi_old, values), and epochs x minibatches of optimizer steps.

An optimizer step is made of shared pieces: `minibatches` picks its micro-batches; `_minibatch_counts`
counts its loss denominators over all of them (and every rank) before any forward; the pure objective
(`posttrain.algos.objective.rl_objective`) gives each micro-batch's loss sums; `accumulate_gradients`
(as in SFT and DPO) divides those by the minibatch's denominators and backwards them, so the gradient is
that of the whole minibatch whatever the split."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posttrain.algos import AGGREGATIONS
from posttrain.algos.objective import rl_objective, sampler_mismatch
from posttrain.distributed.env import all_reduce_sum, reduce_metrics
from posttrain.models.moe import moe_blocks, router_loss_and_metrics
from posttrain.rollout.batch import RolloutBatch
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.optim import optimizer_step
from posttrain.trainers.packed_groups import ROW_TOKENS, PackedGroups, pack_groups
from posttrain.trainers.rl.metrics import WeightedMeans
from posttrain.trainers.rl.run import RLRun, policy_forward
from posttrain.trainers.rl.zero_advantage import TrainedPack, trained_packs, zero_advantage_is_free


@dataclass
class StepBatch:
    """The step's samples as (B, L) tensors, and its packed micro-batches."""

    packs: list[PackedGroups]
    slices: list[slice]  # the samples of each micro-batch
    mask: Tensor  # (B, L) completion tokens the model sampled (episodes: not the observations between turns)
    rollout_logprobs: Tensor  # (B, L) the engine's, at sampling
    rewards: Tensor  # (B,)
    num_groups: int
    turn_rewards: Tensor | None = None  # (B, L) episodes with env.turn_rewards=per_turn: on each turn's last token


@dataclass
class UpdateTargets:
    """What the update fits, for every sample of the step's batch."""

    advantages: Tensor  # (B,) per sample, or (B, L) per token
    loss_mask: Tensor  # (B, L) the tokens in the loss (PPO: without the unscorable samples)
    old_logprobs: Tensor | None = None  # (B, L) pi_old; None: the update's own logprobs, detached
    ref_logprobs: Tensor | None = None  # (B, L) with kl.beta > 0
    old_values: Tensor | None = None  # (B, L) PPO: the value head at the rollout's weights
    returns: Tensor | None = None  # (B, L) PPO: the value targets


def _pad(rows: list[list[float]], width: int, device: torch.device) -> Tensor:
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def prepare_batch(run: RLRun, batch: RolloutBatch) -> StepBatch:
    G = batch.group_size
    micro = run.rank_sizes[2] // G  # groups per micro-batch
    groups = batch.group_completions()
    # Episodes: logits for the model's own tokens only; the environment's (most of a game's) are context.
    scored = batch.grouped(batch.completion_mask) if batch.completion_mask is not None else None
    packs, slices = [], []
    for g0 in range(0, batch.num_groups, micro):
        g1 = min(g0 + micro, batch.num_groups)
        chosen = scored[g0:g1] if scored is not None else None
        packs.append(
            pack_groups(batch.prompt_ids[g0:g1], groups[g0:g1], run.device, scored=chosen, row_tokens=ROW_TOKENS)
        )
        slices.append(slice(g0 * G, g1 * G))
    lengths = [len(ids) for ids in batch.completion_ids]
    L = max(lengths)
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).float().to(run.device)  # (B, L)
    if batch.completion_mask is not None:  # episodes: the model's own tokens only, never the observations
        mask = mask * _pad(batch.completion_mask, L, run.device)
    turn_rewards = _pad(batch.token_rewards, L, run.device) if batch.token_rewards is not None else None
    return StepBatch(
        packs,
        slices,
        mask,
        _pad(batch.rollout_logprobs, L, run.device),
        batch.rewards.to(run.device),
        batch.num_groups,
        turn_rewards,
    )


def update_claims(run: RLRun) -> AbstractContextManager:
    """Around the update: async in one process, claims within every forward and backward as well
    (CoreShare.autograd_claims), so a long micro-batch takes the cores as soon as the rollout thread goes idle."""
    return run.async_rollout.update_claims() if run.async_rollout is not None else nullcontext()


def claim_cores(run: RLRun) -> None:
    """Before each micro-batch: async in one process, this thread takes the cores the rollout thread leaves it
    (all of them while it waits at the staleness bound, rollout/core_share.py)."""
    if run.async_rollout is not None:
        run.async_rollout.claim_cores()


@torch.no_grad()
def scoring_pass(
    run: RLRun, data: StepBatch, module: nn.Module, with_values: bool, base_only: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(B, L) logprobs (and values) of `module` over the whole batch, no grad."""
    B, L = data.mask.shape
    logprobs = torch.zeros(B, L, device=run.device)
    values = torch.zeros(B, L, device=run.device) if with_values else None
    context = nullcontext()
    if base_only:
        from posttrain.peft import disable_adapters

        context = disable_adapters(module)
    with context:
        for pack, rows in zip(data.packs, data.slices):
            claim_cores(run)
            out = policy_forward(run, module, pack, value_head=run.value_head if with_values else None)
            logprobs[rows, : pack.max_len] = out.logprobs
            if values is not None:
                values[rows, : pack.max_len] = out.values
    return logprobs, values


def minibatches(num_micro: int, per_minibatch: int, epochs: int) -> Iterator[list[int]]:
    """The micro-batches of each optimizer step, epoch after epoch; epochs after the first shuffle them
    (torch's generator)."""
    for epoch in range(epochs):
        order = list(range(num_micro))
        if epoch > 0:
            order = [order[i] for i in torch.randperm(len(order)).tolist()]
        for start in range(0, len(order), per_minibatch):
            yield order[start : start + per_minibatch]


def update_policy(run: RLRun, step: int, data: StepBatch, targets: UpdateTargets) -> tuple[dict[str, float], int]:
    """Epochs x minibatches of optimizer steps; returns the metrics and the tokens processed."""
    _, minibatch, micro = run.rank_sizes
    means, tokens = WeightedMeans(), 0
    plan = _trained_packs(run, data, targets.advantages)
    means.add({"update/skipped_group_frac": sum(p.skipped_groups for p in plan) / data.num_groups}, 1.0)
    run.model.train()
    with update_claims(run):
        for update, chosen in enumerate(minibatches(len(plan), max(minibatch // micro, 1), run.cfg.train.epochs)):
            masks = [targets.loss_mask[data.slices[m], : data.packs[m].max_len] for m in chosen]
            counts = _minibatch_counts(run, masks)
            denominators = {key: max(count, 1.0) for key, count in counts.items()}
            run.optimizer.zero_grad(set_to_none=True)
            trained = [plan[m] for m in chosen if plan[m].pack is not None]  # a zero-advantage micro-batch adds 0
            if not trained:
                # Nothing to differentiate, yet the optimizer still steps (Adam's moments and weight decay
                # move the weights) exactly as with the zero gradient the full pass would have given.
                for param in run.trainable:
                    param.grad = torch.zeros_like(param)
            out = accumulate_gradients(
                trained,
                lambda m: _micro_loss(run, data, targets, m, denominators, means, first=update == 0),  # noqa: B023 (called in this iteration)
                denominators,
                run.parallel,
            )
            tokens += out.pop("tokens", 0)
            _optimizer_step(run, step, out, counts["tokens"], means)
    run.model.eval()
    return means.result(), tokens


def _minibatch_counts(run: RLRun, masks: list[Tensor]) -> dict[str, float]:
    """The minibatch's loss denominators from its micro-batches' (b, L) loss masks, summed over every rank:
    the policy term's (its aggregation's count) and the tokens (the value and router losses are token means)."""
    aggregation, max_len = AGGREGATIONS[run.objective.aggregation], run.objective.max_len
    counts = {
        "policy": float(sum(aggregation.denominator(m, max_len) for m in masks)),
        "tokens": float(sum(m.sum() for m in masks)),
    }
    return reduce_metrics(counts, set(counts), run.device)


def _micro_loss(
    run: RLRun,
    data: StepBatch,
    targets: UpdateTargets,
    micro: TrainedPack,
    denominators: dict[str, float],
    means: WeightedMeans,
    first: bool,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """One micro-batch's forward and objective: its loss sums by denominator (see `_minibatch_counts`), and its
    parts of the logged losses; the diagnostics go to `means`, weighted by the micro-batch's tokens."""
    claim_cores(run)
    pack, rows, L = micro.pack, micro.rows, micro.pack.max_len

    def take(per_token: Tensor | None) -> Tensor | None:  # (B, L) -> this micro-batch's (b, L_m)
        return None if per_token is None else per_token[rows, :L]

    mask, rollout, adv = take(targets.loss_mask), take(data.rollout_logprobs), targets.advantages
    out = policy_forward(
        run, run.model, pack, with_entropy=True, entropy_grad=run.objective.entropy_coef > 0, value_head=run.value_head
    )
    objective = rl_objective(
        out.logprobs,
        adv[rows] if adv.dim() == 1 else take(adv),
        mask,
        run.objective,
        old_logprobs=take(targets.old_logprobs),
        rollout_logprobs=rollout,
        ref_logprobs=take(targets.ref_logprobs),
        entropy=out.entropy,
        values=out.values,
        old_values=take(targets.old_values),
        returns=take(targets.returns),
    )
    metrics = objective.metrics
    if first:  # the trainer-engine difference, at the weights that sampled
        metrics.update(sampler_mismatch(out.logprobs, rollout, mask))
    sums = {"policy": objective.policy.sum}
    logged = {
        "loss/policy": float(objective.policy.sum.detach()) / denominators["policy"],
        "tokens": pack.num_input_tokens,
    }
    by_token = []
    if objective.value is not None:
        by_token.append(run.cfg.ppo.vf_coef * objective.value.sum)
        logged["loss/value"] = float(objective.value.sum.detach()) / denominators["tokens"]
    # Mixture-of-experts models: + the router's load-balancing loss (a token mean), router/* metrics.
    # Real tokens of a packed row are those that see its first (prompt) token; padding sees itself only.
    router_loss, router_metrics = router_loss_and_metrics(run.model, pack.mask[:, 0, :, 0])
    if router_loss is not None:
        by_token.append(router_loss * mask.sum())
    metrics.update(router_metrics)
    if by_token:
        sums["tokens"] = sum(by_token[1:], by_token[0])
    means.add(metrics, float(mask.sum()))  # diagnostics: over the samples that trained
    return sums, logged


def _optimizer_step(run: RLRun, step: int, out: dict[str, float], tokens: float, means: WeightedMeans) -> None:
    """The optimizer step on the accumulated minibatch gradient; its losses go to `means`, the parts
    weighted by the minibatch's `tokens`."""
    sums = {"loss": out["loss"], "loss/policy": out.get("loss/policy", 0.0)}
    if run.value_head is not None:
        sums["loss/value"] = out.get("loss/value", 0.0)
    if run.parallel is not None and run.parallel.world > 1:  # each rank holds its part of the minibatch sums
        reduced = all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64, device=run.device))
        sums = dict(zip(sums, reduced.tolist()))
    minibatch_loss = sums.pop("loss")
    means.add(sums, tokens)
    lr = run.scheduler.get_last_lr()[0]
    # The weights change between two engine steps (a rollout thread may be stepping the engine: async mode), and
    # the tokens drawn after this record the new version.
    waited = time.perf_counter()
    with run.llm.weights_lock:
        locked = time.perf_counter()
        grad_norm, applied = optimizer_step(
            run.optimizer, run.scheduler, run.cfg.optim.max_grad_norm, loss=minibatch_loss
        )
        started_sync = time.perf_counter()
        # The engine's next forward runs on the new weights (a rollout thread's running sequences over their K/V).
        run.llm.weights_updated(keep_running_kv=run.cfg.rollout.running_kv == "keep")
    if run.async_rollout is not None:  # in one process the weight sync is the wait for an engine step's end + this
        means.add({"async/weight_sync_s": locked - waited + time.perf_counter() - started_sync}, 1.0)
    if run.guard is not None:
        run.guard.record(step, applied, minibatch_loss, grad_norm)
    means.add({"loss": minibatch_loss, "grad_norm": grad_norm, "lr": lr, "skipped_updates": float(not applied)}, 1.0)
    run.optimizer_steps += 1


def _trained_packs(run: RLRun, data: StepBatch, adv: Tensor) -> list[TrainedPack]:
    """The micro-batches the update runs: all of them, or without their zero-advantage groups when
    those contribute exactly no gradient (see posttrain.trainers.rl.zero_advantage)."""
    cfg, params = run.cfg, run.objective
    free = zero_advantage_is_free(
        adv,
        kl_loss=params.kl_coef > 0,
        entropy_coef=params.entropy_coef,
        value_head=run.value_head is not None,
        router_loss=bool(moe_blocks(run.model)),
    )
    if not (cfg.train.skip_zero_advantage and free):
        return [TrainedPack(pack, rows, 0) for pack, rows in zip(data.packs, data.slices)]
    return trained_packs(
        data.packs,
        data.slices,
        adv,
        cfg.rollout.samples_per_prompt,
        keep_one=run.parallel is not None and run.parallel.world > 1,
    )

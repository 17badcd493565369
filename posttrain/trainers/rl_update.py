"""The update half of an RL step: the step's samples as tensors and packed micro-batches, the no-grad
scoring passes (reference, pi_old, values), and epochs x minibatches of the policy loss with gradient
accumulation whose normalisers span the whole minibatch."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posttrain.algos import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, masked_mean, value_loss
from posttrain.distributed.env import all_reduce_sum, reduce_metrics
from posttrain.models.moe import moe_blocks, router_loss_and_metrics
from posttrain.trainers.optim import optimizer_step
from posttrain.trainers.rl_batch import PackedGroups, pack_groups
from posttrain.trainers.rl_config import rank_batch_sizes
from posttrain.trainers.rl_metrics import WeightedMeans
from posttrain.trainers.rl_run import RLRun, policy_forward
from posttrain.rollout.batch import RolloutBatch
from posttrain.trainers.zero_advantage import TrainedPack, trained_packs, zero_advantage_is_free


@dataclass
class StepBatch:
    """The step's samples as (B, L) tensors, and its packed micro-batches."""

    packs: list[PackedGroups]
    slices: list[slice]  # the samples of each micro-batch
    mask: Tensor  # (B, L) completion tokens (the loss mask)
    rollout_logprobs: Tensor  # (B, L)
    rewards: Tensor  # (B,)
    prompt_ids: list[list[int]]  # (P groups) each group's prompt, to re-pack a subset of its groups
    groups: list[list[list[int]]]  # (P groups, G) completion ids


def _pad(rows: list[list[float]], width: int, device: torch.device) -> Tensor:
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def prepare_batch(run: RLRun, batch: RolloutBatch) -> StepBatch:
    G = batch.group_size
    world = run.parallel.world if run.parallel is not None else 1
    micro = rank_batch_sizes(run.cfg, world)[2] // G  # groups per micro-batch
    groups = batch.group_completions()
    packs, slices = [], []
    for g0 in range(0, batch.num_groups, micro):
        g1 = min(g0 + micro, batch.num_groups)
        packs.append(pack_groups(batch.prompt_ids[g0:g1], groups[g0:g1], run.device))
        slices.append(slice(g0 * G, g1 * G))
    lengths = [len(ids) for ids in batch.completion_ids]
    L = max(lengths)
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).float().to(run.device)  # (B, L)
    return StepBatch(packs, slices, mask, _pad(batch.rollout_logprobs, L, run.device), batch.rewards.to(run.device),
                     batch.prompt_ids, groups)


@torch.no_grad()
def scoring_pass(run: RLRun, data: StepBatch, module: nn.Module, with_values: bool,
                 base_only: bool = False) -> tuple[Tensor, Tensor | None]:
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
            out = policy_forward(run, module, pack, value_head=run.value_head if with_values else None)
            logprobs[rows, : pack.max_len] = out.logprobs
            if values is not None:
                values[rows, : pack.max_len] = out.values
    return logprobs, values


def _share(aggregation: str, mask: Tensor, totals: dict[str, float]) -> float:
    """This micro-batch's part of the minibatch normaliser, so that summing micro-batch losses gives
    exactly the aggregation over the whole minibatch."""
    if aggregation == "token-mean":
        return float(mask.sum()) / max(totals["tokens"], 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        return mask.shape[0] / max(totals["rows"], 1.0)
    return float((mask.sum(1) > 0).sum()) / max(totals["seqs"], 1.0)


def update_policy(run: RLRun, step: int, data: StepBatch, adv: Tensor, old: Tensor | None, ref: Tensor | None,
                  old_values: Tensor | None, returns: Tensor | None, loss_mask: Tensor) -> tuple[dict[str, float], int]:
    """Epochs x minibatches of optimizer steps; returns the metrics and the tokens processed."""
    cfg, algo = run.cfg, run.algo
    parallel = run.parallel
    world = parallel.world if parallel is not None else 1
    _, minibatch, micro = rank_batch_sizes(cfg, world)  # this rank's share
    per_minibatch = max(minibatch // micro, 1)  # this rank's micro-batches of each minibatch
    scale = parallel.loss_scale if parallel is not None else 1.0
    policy_loss = POLICY_LOSSES[algo.policy_loss]
    aggregate = AGGREGATIONS[algo.aggregation]
    means = WeightedMeans()
    tokens = 0
    first_update = True
    plan = _trained_packs(run, data, adv, ref)
    means.add({"update/skipped_group_frac": sum(p.skipped_groups for p in plan) / len(data.groups)}, 1.0)
    run.model.train()
    for epoch in range(cfg.train.epochs):
        order = list(range(len(data.packs)))
        if epoch > 0:
            order = [order[i] for i in torch.randperm(len(order)).tolist()]
        for start in range(0, len(order), per_minibatch):
            chosen = order[start : start + per_minibatch]
            masks = [loss_mask[data.slices[m], : data.packs[m].max_len] for m in chosen]
            totals = {"tokens": float(sum(m.sum() for m in masks)),
                      "seqs": float(sum((m.sum(1) > 0).sum() for m in masks)),
                      "rows": float(sum(m.shape[0] for m in masks))}
            # The minibatch is every rank's micro-batches: its normalisers are counted over all of them.
            totals = reduce_metrics(totals, set(totals), run.device)
            run.optimizer.zero_grad(set_to_none=True)
            # The minibatch's loss and its logged parts, each the sum of its micro-batch terms (each already
            # normalised by the whole minibatch). A group left out for zero advantage would add exactly 0, so
            # these sums equal the full pass's; a mean over the micro-batches that ran would not.
            parts = ["loss/policy"] + (["loss/value"] if run.value_head is not None else [])
            sums = dict.fromkeys(["loss", *parts], 0.0)
            if all(plan[m].pack is None for m in chosen):
                # Nothing to differentiate, yet the optimizer still steps (Adam's moments and weight decay
                # move the weights) exactly as with the zero gradient the full pass would have given.
                for param in run.trainable:
                    param.grad = torch.zeros_like(param)
            for index, m in enumerate(chosen):
                pack, rows = plan[m].pack, plan[m].rows
                if pack is None:  # every group of this micro-batch has zero advantage: zero gradient
                    continue
                with parallel.grad_sync(index == len(chosen) - 1) if parallel is not None else nullcontext():
                    Lm = pack.max_len
                    mask = loss_mask[rows, :Lm]
                    out = policy_forward(run, run.model, pack, with_entropy=True,
                                         entropy_grad=cfg.loss.entropy_coef > 0, value_head=run.value_head)
                    logprobs = out.logprobs  # (b, Lm)
                    old_m = old[rows, :Lm] if old is not None else logprobs.detach()
                    adv_m = adv[rows] if adv.dim() == 1 else adv[rows, :Lm]
                    per_token, metrics = policy_loss(logprobs, old_m, adv_m, mask, **algo.loss_kwargs)
                    rollout_m = data.rollout_logprobs[rows, :Lm]
                    if first_update:
                        diff = (logprobs.detach() - rollout_m).abs() * mask
                        metrics["mismatch/abs_diff_mean"] = masked_mean(diff, mask)
                        metrics["mismatch/abs_diff_max"] = diff.max()
                    if cfg.train.tis_cap is not None:
                        weight = torch.exp(old_m - rollout_m).clamp(max=cfg.train.tis_cap).detach()  # (b, Lm)
                        per_token = per_token * weight
                        metrics["tis/weight_mean"] = masked_mean(weight, mask)
                    if ref is not None:
                        kl = KL_ESTIMATORS[cfg.kl.estimator](logprobs, ref[rows, :Lm])  # (b, Lm)
                        metrics["kl"] = masked_mean(kl.detach(), mask)
                        if not cfg.kl.in_reward:
                            per_token = per_token + cfg.kl.beta * kl
                    if cfg.loss.entropy_coef > 0:
                        per_token = per_token - cfg.loss.entropy_coef * out.entropy
                    metrics["entropy"] = masked_mean(out.entropy.detach(), mask)
                    loss = aggregate(per_token, mask, max_len=cfg.rollout.max_tokens) * _share(algo.aggregation, mask, totals)
                    sums["loss/policy"] += float(loss.detach())
                    if run.value_head is not None:
                        v_loss, v_metrics = value_loss(out.values, old_values[rows, :Lm], returns[rows, :Lm], mask,
                                                       clip_eps=cfg.ppo.value_clip)
                        v_loss = AGGREGATIONS["token-mean"](v_loss, mask) * _share("token-mean", mask, totals)
                        loss = loss + cfg.ppo.vf_coef * v_loss
                        metrics.update(v_metrics)
                        sums["loss/value"] += float(v_loss.detach())
                        metrics["value/mean"] = masked_mean(out.values.detach(), mask)
                    # Mixture-of-experts models: + the router's load-balancing loss (a token mean), router/* metrics.
                    # Real tokens of a packed row are those that see its first (prompt) token; padding sees itself only.
                    router_loss, router_metrics = router_loss_and_metrics(run.model, pack.mask[:, 0, :, 0])
                    if router_loss is not None:
                        loss = loss + router_loss * _share("token-mean", mask, totals)
                    metrics.update(router_metrics)
                    (loss * scale if scale != 1.0 else loss).backward()  # scale: see posttrain.distributed.parallel
                    sums["loss"] += float(loss.detach())
                    tokens += pack.num_input_tokens
                    means.add(metrics, float(mask.sum()))  # diagnostics: over the samples that trained
            if world > 1:  # each rank holds its part of the globally-normalised minibatch sums
                reduced = all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64, device=run.device))
                sums = dict(zip(sums, reduced.tolist()))
            minibatch_loss = sums.pop("loss")
            means.add(sums, totals["tokens"])  # the parts: token-weighted over the minibatches
            lr = run.scheduler.get_last_lr()[0]
            grad_norm, applied = optimizer_step(run.optimizer, run.scheduler, cfg.optim.max_grad_norm,
                                                loss=minibatch_loss)
            if run.guard is not None:
                run.guard.record(step, applied, minibatch_loss, grad_norm)
            means.add({"loss": minibatch_loss, "grad_norm": grad_norm, "lr": lr, "skipped_updates": float(not applied)},
                      1.0)
            run.optimizer_steps += 1
            run.llm.weights_updated()  # the engine's next rollout runs on the new weights
            first_update = False
    run.model.eval()
    return means.result(), tokens


def _trained_packs(run: RLRun, data: StepBatch, adv: Tensor, ref: Tensor | None) -> list[TrainedPack]:
    """The micro-batches the update runs: all of them, or without their zero-advantage groups when
    those contribute exactly no gradient (see posttrain.trainers.zero_advantage)."""
    cfg = run.cfg
    free = zero_advantage_is_free(adv, kl_loss=ref is not None and not cfg.kl.in_reward,
                                  entropy_coef=cfg.loss.entropy_coef, value_head=run.value_head is not None,
                                  router_loss=bool(moe_blocks(run.model)))
    if not (cfg.train.skip_zero_advantage and free):
        return [TrainedPack(pack, rows, 0) for pack, rows in zip(data.packs, data.slices)]
    return trained_packs(data.packs, data.slices, adv, data.prompt_ids, data.groups,
                         cfg.rollout.samples_per_prompt,
                         keep_one=run.parallel is not None and run.parallel.world > 1)

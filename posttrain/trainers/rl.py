"""The RL loop for the GRPO family and PPO, on the rollout engine over the live policy module.

One step:
  1. rollout   the engine samples G completions for each of P fresh prompts from the module being
               trained (no weight copy); rewards (NaN = unscorable), DAPO shaping / dynamic sampling
  2. passes    reference logprobs when kl.beta > 0 (a frozen copy, or the base with LoRA off);
               an "old" no-grad pass only when it is needed (see below)
  3. advantage the algorithm's estimator on the whole batch
  4. update    epochs x minibatches of the clipped policy loss (+ KL, entropy, value loss); after
               every optimizer step `llm.weights_updated()`, and the next rollout sees the new weights

The training forward packs each group as one row with its prompt computed once (`rl_batch`), and
projects only completion positions through the LM head.

pi_old, the denominator of the importance ratio (`train.old_logprobs`):
  - a single update per rollout (one epoch, one minibatch): the logprobs of the update's own forward,
    detached. The weights that sampled are the weights being differentiated, so this IS pi_old, and
    the ratio is exactly 1 with the policy gradient as its gradient; no extra pass.
  - several updates: a no-grad pass before the first update ("recompute"), or the engine's sampling
    logprobs ("rollout"), which come from the same weights through the paged kernel (they agree with
    the dense forward to ~1e-5 in fp32; bf16 kernels differ more, so recompute is the default).
  The engine's logprobs are always the behaviour policy: `train.tis_cap` weighs each token's loss by
  min(pi_old / pi_engine, cap) (truncated importance sampling), and `mismatch/*` metrics report the
  trainer-engine difference on the first update of every step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algos import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, masked_mean, value_loss
from posttrain.engine import LLM, EngineConfig, SamplingParams
from posttrain.dist.env import all_reduce_count, broadcast_object, is_main, reduce_metrics
from posttrain.dist.parallel import Parallel
from posttrain.errors import ConfigError, PosttrainError
from posttrain.metrics import MetricsLogger
from posttrain.models.moe import router_loss_and_metrics
from posttrain.rewards import RewardSpec
from posttrain.trainers.adapters import has_adapters, prepare_trainable, save_final_dir
from posttrain.trainers.faults import BadStepGuard
from posttrain.trainers.ppo import ValueHead, ppo_advantages, save_value_head, whiten_over_ranks
from posttrain.trainers.rl_batch import PackedGroups, pack_groups, packed_forward
from posttrain.trainers.rl_config import (
    GRPOConfig,
    PPOConfig,
    ResolvedAlgorithm,
    RLConfig,
    batch_sizes,
    rank_batch_sizes,
    resolve_algorithm,
    validate_tree,
)
from posttrain.trainers.rl_metrics import StepTimer, WeightedMeans, batch_metrics, headline, peak_memory_gb, progress_bar
from posttrain.trainers.optim import build_optimizer, optimizer_step
from posttrain.trainers.resume import open_run
from posttrain.trainers.schedule import build_scheduler, warmup_steps_for
from posttrain.trainers.rollout import (
    OverlongShaping,
    PromptSource,
    RolloutBatch,
    check_prompt_lengths,
    collect_rollout,
    data_columns,
    evaluate,
    load_reward_specs,
    make_prompt_source,
    prompt_seed_base,
)
from posttrain.trainers.distributed import join_processes, save_final_parallel
from posttrain.trainers.train_state import Checkpointer

OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# Under torchrun: metrics that are each rank's part of a total (the others are averaged over the ranks).
SUMMED_METRICS = frozenset({"num_samples", "dapo/kept_groups", "reward/unscorable", "tokens/rollout_per_s", "tokens/train_per_s"})


@dataclass
class RLRun:
    """Everything one training run holds; built by `setup_run`, advanced by `rl_step`."""

    cfg: RLConfig
    algo: ResolvedAlgorithm
    run_dir: Path
    model: nn.Module
    tokenizer: Any
    llm: LLM
    source: PromptSource
    specs: list[RewardSpec]
    held_out: list[dict[str, Any]]
    params: SamplingParams
    overlong: OverlongShaping | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    trainable: list[nn.Parameter]
    logger: MetricsLogger | None  # None on torchrun ranks other than 0
    value_head: ValueHead | None = None
    reference: nn.Module | None = None  # a frozen copy; None with beta == 0 or with LoRA (base = adapters off)
    optimizer_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    guard: BadStepGuard | None = None  # counts skipped (non-finite) updates; set by setup_run
    checkpointer: Checkpointer | None = None  # set by setup_run
    start_step: int = 0  # RL steps already done: > 0 when resumed from a checkpoint
    parallel: Parallel | None = None  # set by setup_run: the policy as torchrun's ranks share it

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def uses_reference(self) -> bool:
        return self.cfg.kl.beta > 0


# ----------------------------------------------------------------------------- setup


def _engine_config(cfg: RLConfig) -> EngineConfig:
    """The engine section, with max_model_len / max_num_seqs sized to the rollout when left at defaults."""
    engine = dataclasses.replace(cfg.rollout.engine)
    defaults = EngineConfig()
    eval_tokens = cfg.eval.max_tokens or cfg.rollout.max_tokens
    if engine.max_model_len is None:
        engine.max_model_len = cfg.rollout.max_prompt_tokens + max(cfg.rollout.max_tokens, eval_tokens)
    if engine.max_num_seqs == defaults.max_num_seqs:  # a rollout (or a held-out evaluation) in one wave
        engine.max_num_seqs = min(defaults.max_num_seqs, max(batch_sizes(cfg)[0], cfg.data.eval_size))
        engine.max_num_batched_tokens = max(engine.max_num_batched_tokens, engine.max_num_seqs)
    engine.validate()
    return engine


def setup_run(cfg: RLConfig, command: str, *, model: nn.Module | None = None, tokenizer: Any = None) -> RLRun:
    """Check everything that can be checked without compute (config, data, reward signatures), then
    load the model, build the engine over it, the optimizer and the run directory."""
    validate_tree(cfg)
    algo = resolve_algorithm(cfg)
    dist_section = cfg.dist
    ctx, model_section = join_processes(dist_section, cfg.model)
    source = make_prompt_source(cfg.data)
    columns = data_columns(source)
    specs = load_reward_specs(cfg.reward, cfg.data, source, columns)
    held_out = source.held_out(cfg.data.eval_size) if cfg.data.eval_size else []
    if (model is None) != (tokenizer is None):
        raise PosttrainError("pass both model= and tokenizer= (or neither, to load model.name_or_path)")
    start = open_run(command, cfg)  # an occupied --out fails here, before the model loads
    run_dir = start.run_dir
    if model is None:
        from posttrain.models.hub import load_model

        model, tokenizer = load_model(model_section.name_or_path, dtype=model_section.dtype, device=model_section.device)
    check_prompt_lengths(source, held_out, tokenizer, cfg.rollout.max_prompt_tokens)
    # Each rank's unseeded rollouts draw from their own stream (rank 0's is the single-process one).
    torch.manual_seed(cfg.train.seed + ctx.rank)
    prepare_trainable(model, lora=cfg.lora, quant=cfg.quant)  # adapters (over a quantized base with quant)
    reference = None
    if cfg.kl.beta > 0 and not has_adapters(model):
        reference = copy.deepcopy(model).eval().requires_grad_(False)  # a whole frozen copy on every rank
    value_head = None
    if algo.uses_value_head:  # PPO's critic on the policy trunk; DDP reduces its gradients with the trunk's
        value_head = ValueHead(model.config.hidden_size, model.dtype, model.device)
    beside = {"value_head": value_head} if value_head is not None else None
    # Before the optimizer: FSDP2 replaces the Parameters by shards.
    parallel = Parallel(model, dist_section, ctx, beside=beside)
    try:
        rank_batch_sizes(cfg, parallel.world)  # every rank the same whole groups, minibatches and micro-batches
    except ValueError as error:
        raise ConfigError(str(error)) from None
    optim = cfg.optim
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps)
    if value_head is not None:  # its own group: a fresh head learns at its own (higher) rate
        optimizer.add_param_group({"params": list(value_head.parameters()),
                                   "lr": cfg.ppo.value_lr or optim.lr * 100, "weight_decay": 0.0})
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    batch, minibatch, _ = batch_sizes(cfg)
    total = cfg.train.max_steps * cfg.train.epochs * (batch // minibatch)  # optimizer steps
    scheduler = build_scheduler(optimizer, total_steps=total, schedule=optim.schedule,
                                warmup_steps=warmup_steps_for(total, optim.warmup_steps, optim.warmup_ratio),
                                min_lr_ratio=optim.min_lr_ratio)
    with parallel.full_weights():
        llm = LLM(model=model, tokenizer=tokenizer, config=_engine_config(cfg))
    params = SamplingParams(
        n=cfg.rollout.samples_per_prompt, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_tokens, logprobs=True,
    )
    overlong = None
    if algo.overlong_penalty:
        overlong = OverlongShaping(cfg.rollout.max_tokens, cfg.dapo.overlong_cache_len, cfg.dapo.overlong_penalty_factor)
    logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard) if is_main() else None
    run = RLRun(cfg, algo, run_dir, model, tokenizer, llm, source, specs, held_out, params, overlong,
                optimizer, scheduler, trainable, logger, value_head, reference,
                guard=BadStepGuard(cfg.train.max_bad_steps), parallel=parallel)
    # Rollouts draw from torch's generator (unseeded requests), which the checkpoint restores; a reference
    # copy was taken above from the initial weights, before any restore.
    run.checkpointer = Checkpointer(
        command, run_dir, model, tokenizer, cfg.model.name_or_path, optimizer, scheduler,
        modules={"value_head": value_head} if value_head is not None else {},
        state={"prompts": source, "faults": run.guard, "counters": _Counters(run)},
        keep_last=cfg.train.keep_checkpoints,
        write_extras=(lambda d: save_value_head(value_head, d)) if value_head is not None else None,
        parallel=parallel,
    )
    if start.checkpoint is not None:
        run.start_step = run.checkpointer.restore(start.checkpoint)
    return run


def _policy_forward(run: RLRun, module: nn.Module, pack: PackedGroups, **kwargs: Any) -> Any:
    """packed_forward of `module`; the policy goes through its DDP / FSDP2 wrapper, a frozen copy does not."""
    temperature = run.cfg.rollout.temperature
    if module is run.model and run.parallel is not None:
        return run.parallel.run(lambda m, p: packed_forward(m, p, temperature, **kwargs), pack)
    return packed_forward(module, pack, temperature, **kwargs)


class _Counters:
    """The run's optimizer-step count and the engine's policy version, as checkpoint state."""

    def __init__(self, run: RLRun) -> None:
        self.run = run

    def state_dict(self) -> dict[str, int]:
        return {"optimizer_steps": self.run.optimizer_steps, "policy_version": self.run.llm.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run.optimizer_steps = int(state["optimizer_steps"])
        # The engine's version only counts up; on a fresh, idle engine each bump just clears an empty cache.
        while self.run.llm.policy_version < int(state["policy_version"]):
            self.run.llm.weights_updated()


# ----------------------------------------------------------------------------- one step


@dataclass
class _Batch:
    """The step's samples as (B, L) tensors, and its packed micro-batches."""

    packs: list[PackedGroups]
    slices: list[slice]  # the samples of each micro-batch
    mask: Tensor  # (B, L) completion tokens (the loss mask)
    rollout_logprobs: Tensor  # (B, L)
    rewards: Tensor  # (B,)


def _pad(rows: list[list[float]], width: int, device: torch.device) -> Tensor:
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def _prepare(run: RLRun, batch: RolloutBatch) -> _Batch:
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
    return _Batch(packs, slices, mask, _pad(batch.rollout_logprobs, L, run.device), batch.rewards.to(run.device))


@torch.no_grad()
def _scoring_pass(run: RLRun, data: _Batch, module: nn.Module, with_values: bool,
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
            out = _policy_forward(run, module, pack, value_head=run.value_head if with_values else None)
            logprobs[rows, : pack.max_len] = out.logprobs
            if values is not None:
                values[rows, : pack.max_len] = out.values
    return logprobs, values


def _advantages(run: RLRun, data: _Batch, behaviour: Tensor, ref: Tensor | None,
                values: Tensor | None, loss_mask: Tensor) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """Advantages (B,) or (B, L), value targets (PPO) and reward-side KL metrics."""
    cfg, algo = run.cfg, run.algo
    G = cfg.rollout.samples_per_prompt
    metrics: dict[str, float] = {}
    kl_tokens = None
    if ref is not None and cfg.kl.in_reward:
        kl_tokens = KL_ESTIMATORS[cfg.kl.estimator](behaviour, ref) * data.mask  # (B, L)
        metrics["kl/in_reward_mean"] = float((kl_tokens.sum(1)).mean())
    rewards = data.rewards
    if algo.advantage in OUTCOME_ESTIMATORS:
        if kl_tokens is not None:
            rewards = rewards - cfg.kl.beta * kl_tokens.sum(1)  # sequence reward shaped by its summed KL
        return ADVANTAGE_ESTIMATORS[algo.advantage](rewards, G), None, metrics
    world = run.parallel.world if run.parallel is not None else 1
    if algo.advantage == "reinforce_pp":
        adv, returns = ADVANTAGE_ESTIMATORS["reinforce_pp"](rewards, data.mask, gamma=1.0, per_token_kl=kl_tokens,
                                                             kl_coef=cfg.kl.beta)  # (B, L), (B, L)
        if world > 1:
            # The estimator whitened over this rank's tokens only: whiten the returns again with the mean and
            # variance of every rank's scorable tokens, as one process whitens the whole batch.
            scorable = ~torch.isnan(rewards)  # (B,)
            adv = whiten_over_ranks(returns, data.mask.float() * scorable.unsqueeze(1))
        return adv, None, metrics
    ppo = cfg.ppo
    adv, returns = ppo_advantages(rewards, values, loss_mask, gamma=ppo.gamma, lam=ppo.lam,
                                  whiten=ppo.whiten_advantages and world == 1, per_token_kl=kl_tokens,
                                  kl_coef=cfg.kl.beta)
    if ppo.whiten_advantages and world > 1:  # whitened over the whole batch, every rank's samples
        adv = whiten_over_ranks(adv, loss_mask)
    metrics["value/returns_mean"] = float(masked_mean(returns, loss_mask))
    return adv, returns, metrics


def _share(aggregation: str, mask: Tensor, totals: dict[str, float]) -> float:
    """This micro-batch's part of the minibatch normaliser, so that summing micro-batch losses gives
    exactly the aggregation over the whole minibatch."""
    if aggregation == "token-mean":
        return float(mask.sum()) / max(totals["tokens"], 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        return mask.shape[0] / max(totals["rows"], 1.0)
    return float((mask.sum(1) > 0).sum()) / max(totals["seqs"], 1.0)


def _update(run: RLRun, step: int, data: _Batch, adv: Tensor, old: Tensor | None, ref: Tensor | None,
            old_values: Tensor | None, returns: Tensor | None, loss_mask: Tensor,
            timer: StepTimer) -> tuple[dict[str, float], int]:
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
            minibatch_loss = 0.0  # the sum of the micro-batch losses: the minibatch's loss
            for index, (m, mask) in enumerate(zip(chosen, masks)):
                with parallel.grad_sync(index == len(chosen) - 1) if parallel is not None else nullcontext():
                    pack, rows = data.packs[m], data.slices[m]
                    Lm = pack.max_len
                    out = _policy_forward(run, run.model, pack, with_entropy=True,
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
                    metrics["loss/policy"] = loss.detach()
                    if run.value_head is not None:
                        v_loss, v_metrics = value_loss(out.values, old_values[rows, :Lm], returns[rows, :Lm], mask,
                                                       clip_eps=cfg.ppo.value_clip)
                        v_loss = AGGREGATIONS["token-mean"](v_loss, mask) * _share("token-mean", mask, totals)
                        loss = loss + cfg.ppo.vf_coef * v_loss
                        metrics.update(v_metrics)
                        metrics["loss/value"] = v_loss.detach()
                        metrics["value/mean"] = masked_mean(out.values.detach(), mask)
                    # Mixture-of-experts models: + the router's load-balancing loss (a token mean), router/* metrics.
                    # Real tokens of a packed row are those that see its first (prompt) token; padding sees itself only.
                    router_loss, router_metrics = router_loss_and_metrics(run.model, pack.mask[:, 0, :, 0])
                    if router_loss is not None:
                        loss = loss + router_loss * _share("token-mean", mask, totals)
                    metrics.update(router_metrics)
                    (loss * scale if scale != 1.0 else loss).backward()  # scale: see posttrain.dist.parallel
                    minibatch_loss += float(loss.detach())
                    tokens += pack.num_input_tokens
                    share = float(mask.sum())
                    for key in ("loss/policy", "loss/value"):  # minibatch sums, not means: undo the weighting
                        if key in metrics:
                            metrics[key] = metrics[key] * max(totals["tokens"], 1.0) / max(share, 1.0)
                    means.add(metrics, share)
            if world > 1:  # each rank holds its part of the globally-normalised minibatch loss
                minibatch_loss = all_reduce_count(minibatch_loss, run.device)
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


def _needs_old_pass(run: RLRun, num_samples: int) -> bool:
    """`num_samples`: the step's samples over every rank."""
    cfg = run.cfg
    _, minibatch, _ = batch_sizes(cfg)
    single_update = cfg.train.epochs == 1 and num_samples <= minibatch
    if run.value_head is not None:
        return True  # V at the rollout's weights: GAE needs them for the whole batch before any update
    if cfg.train.old_logprobs == "recompute":
        return True
    return cfg.train.old_logprobs == "auto" and not single_update


def rl_step(run: RLRun, step: int) -> dict[str, Any]:
    """Rollout, rewards, advantages, updates; returns the step's metrics."""
    cfg = run.cfg
    timer = StepTimer()
    step_start, cpu_start = time.perf_counter(), time.process_time()
    parallel = run.parallel
    sharded = parallel is not None and parallel.wrapped is not None
    world = parallel.world if parallel is not None else 1
    with parallel.full_weights() if parallel is not None else nullcontext():  # FSDP2: the engine needs whole weights
        batch, stats = collect_rollout(
            run.llm, run.source, cfg.rollout.prompts_per_step, run.params, run.specs, run.overlong,
            run.algo.dynamic_sampling, cfg.dapo.max_refill_rounds,
            shard=parallel.shard if sharded else None,
            seed_base=prompt_seed_base(cfg.train.seed, step) if cfg.rollout.seed_prompts else None,
        )
    timer.seconds["rollout"] = stats.rollout_s
    timer.seconds["reward"] = stats.reward_s
    metrics: dict[str, Any] = {"zero_variance_frac": stats.zero_variance_frac}
    if run.algo.dynamic_sampling:
        metrics.update({"dapo/refill_rounds": stats.refill_rounds, "dapo/extra_prompts": stats.extra_prompts,
                        "dapo/dropped_groups": stats.dropped_groups,
                        "dapo/kept_groups": batch.num_groups if batch is not None else 0})
    metrics["tokens/rollout_per_s"] = stats.generated_tokens / max(stats.rollout_s, 1e-9)
    if batch is None:  # dynamic sampling left no group with a learning signal
        metrics.update({"skipped": 1, "time/step_s": time.perf_counter() - step_start, **timer.metrics()})
        return metrics
    metrics.update(batch_metrics(batch))
    data = _prepare(run, batch)
    ref = values = old = None
    if run.uses_reference:
        with timer("ref_pass"):
            if run.reference is not None:
                ref, _ = _scoring_pass(run, data, run.reference, with_values=False)
            else:
                ref, _ = _scoring_pass(run, data, run.model, with_values=False, base_only=True)
    if _needs_old_pass(run, batch.num_samples * world):
        with timer("old_pass"):
            old, values = _scoring_pass(run, data, run.model, with_values=run.value_head is not None)
    if cfg.train.old_logprobs == "rollout":
        old = data.rollout_logprobs
    loss_mask = data.mask
    if run.value_head is not None:
        loss_mask = data.mask * (~torch.isnan(data.rewards)).float()[:, None]  # unscorable: out of PPO's loss
    with timer("advantage"):
        behaviour = old if old is not None else data.rollout_logprobs
        adv, returns, adv_metrics = _advantages(run, data, behaviour, ref, values, loss_mask)
    metrics.update(adv_metrics)
    with timer("update"):
        update_metrics, train_tokens = _update(run, step, data, adv, old, ref, values, returns, loss_mask, timer)
    metrics.update(update_metrics)
    metrics["tokens/train_per_s"] = train_tokens / max(timer.seconds["update"], 1e-9)
    metrics["policy_version"] = run.llm.policy_version
    metrics["rollout_policy_version"] = min(batch.policy_versions)
    metrics["optimizer_steps"] = run.optimizer_steps
    metrics["time/step_s"] = time.perf_counter() - step_start
    # CPU seconds of the whole process (all threads): on a shared machine, wall time says more about the
    # neighbours than about the step; CPU time / threads approximates the step on an idle machine.
    metrics["time/step_cpu_s"] = time.process_time() - cpu_start
    metrics.update(timer.metrics())
    metrics.update(peak_memory_gb(run.device))
    if sharded:  # counts and throughputs add up over the ranks; means (over equal shares) average
        metrics = reduce_metrics(metrics, SUMMED_METRICS, run.device)
    return metrics


# ----------------------------------------------------------------------------- the run


def _evaluate(run: RLRun, step: int, bar: Any) -> dict[str, Any]:
    if not run.held_out:
        return {}
    start = time.perf_counter()
    max_tokens = run.cfg.eval.max_tokens or run.cfg.rollout.max_tokens
    # Under torchrun every rank evaluates every held-out prompt (greedy: the same answers everywhere), so the
    # ranks stay in step with no reduction; rank 0 writes.
    with run.parallel.full_weights() if run.parallel is not None else nullcontext():
        metrics, samples = evaluate(run.llm, run.held_out, run.specs, max_tokens, run.cfg.reward.correct_threshold)
    metrics["time/eval_s"] = time.perf_counter() - start
    if not is_main():
        return metrics
    with open(run.run_dir / f"eval-step{step:05d}.jsonl", "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    bar.write(f"step {step}: held-out greedy accuracy {metrics['eval/accuracy']:.3f} "
              f"({len(run.held_out)} prompts, {metrics['time/eval_s']:.1f}s)")
    return metrics


def _save_final(run: RLRun) -> Path:
    # The PEFT adapter with LoRA / QLoRA, else an HF directory; the value head goes beside either.
    if run.parallel is not None and run.parallel.wrapped is not None:
        out = save_final_parallel(run.parallel, run.tokenizer, run.run_dir, base_model=run.cfg.model.name_or_path)
        if run.value_head is not None and is_main():  # ddp: the same head on every rank
            save_value_head(run.value_head, out)
        return out
    out = save_final_dir(run.model, run.tokenizer, run.run_dir, base_model=run.cfg.model.name_or_path)
    if run.value_head is not None:
        save_value_head(run.value_head, out)
    return out


def train(cfg: RLConfig, command: str, *, model: nn.Module | None = None, tokenizer: Any = None) -> Path:
    """Run the RL loop to max_steps or the time budget; returns the run directory."""
    started = time.perf_counter()
    run = setup_run(cfg, command, model=model, tokenizer=tokenizer)
    budget_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes is not None else math.inf
    bar = progress_bar(cfg.train.max_steps, cfg.log.progress and is_main(), f"{command} ({run.algo.name})")
    bar.update(run.start_step)
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "algorithm": run.algo.name}
    try:
        eval_s = 0.0
        if cfg.eval.before and run.held_out and run.start_step == 0:
            before = _evaluate(run, 0, bar)
            eval_s = before["time/eval_s"]
            if run.logger is not None:
                run.logger.log(0, before)
            summary["accuracy_before"] = before["eval/accuracy"]
        step_times: list[float] = []
        step = run.start_step
        for step in range(run.start_step + 1, cfg.train.max_steps + 1):
            elapsed = time.perf_counter() - started
            next_step = max(step_times[-3:]) if step_times else 0.0
            # the step, the final eval and the save fit; rank 0's clock decides for every rank
            if broadcast_object(elapsed + next_step + eval_s * 1.2 + 10 > budget_s):
                bar.write(f"time budget of {cfg.train.max_minutes} min reached after {step - 1} steps")
                step -= 1
                break
            metrics = rl_step(run, step)
            step_times.append(metrics["time/step_s"])
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.max_steps:
                metrics.update(_evaluate(run, step, bar))
            metrics["time/elapsed_min"] = (time.perf_counter() - started) / 60
            if run.logger is not None:
                run.logger.log(step, metrics)
            run.history.append(metrics)
            bar.set_postfix_str(headline(metrics), refresh=False)
            bar.update(1)
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.max_steps:
                run.checkpointer.save(step)
        summary["steps"] = step
        if run.held_out:
            after = _evaluate(run, step, bar)
            if run.logger is not None:
                run.logger.log(step, after)
            summary["accuracy_after"] = after["eval/accuracy"]
        if cfg.save_final:
            summary["final"] = str(_save_final(run))
        summary["minutes"] = round((time.perf_counter() - started) / 60, 2)
        if is_main():
            (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    finally:
        bar.close()
        if run.logger is not None:
            run.logger.close()
    if "accuracy_after" in summary and is_main():
        before_text = f"{summary['accuracy_before']:.1%} -> " if "accuracy_before" in summary else ""
        print(f"held-out greedy accuracy: {before_text}{summary['accuracy_after']:.1%} "
              f"({summary['steps']} steps, {summary['minutes']} min); run: {run.run_dir}")
    return run.run_dir


def train_grpo(cfg: GRPOConfig, *, model: nn.Module | None = None, tokenizer: Any = None) -> Path:
    """Run `posttrain grpo` from a GRPOConfig (any GRPO-family `algorithm`); returns the run directory."""
    if not isinstance(cfg, GRPOConfig):
        raise PosttrainError(f"train_grpo needs a GRPOConfig, got {type(cfg).__name__} (PPO: train_ppo)")
    return train(cfg, "grpo", model=model, tokenizer=tokenizer)


__all__ = ["GRPOConfig", "PPOConfig", "RLRun", "rl_step", "setup_run", "train", "train_grpo"]

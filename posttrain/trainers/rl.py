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
projects only completion positions through the LM head. `rl_run` builds a run (`setup_run`),
`rl_update` holds the passes and the update, `zero_advantage` leaves groups without signal out of it;
this module is the step and the loop.

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

import json
import math
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from posttrain.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, masked_mean
from posttrain.distributed.env import barrier, broadcast_object, is_main, reduce_metrics
from posttrain.distributed.lockstep import Lockstep
from posttrain.errors import PosttrainError
from posttrain.rollout.collect import collect_rollout, prompt_seed_base
from posttrain.rollout.evaluate import evaluate
from posttrain.trainers.adapters import save_final_dir, save_final_parallel
from posttrain.trainers.loop import run_steps
from posttrain.trainers.ppo import ppo_advantages, save_value_head, whiten_over_ranks
from posttrain.trainers.rl_config import GRPOConfig, PPOConfig, RLConfig, batch_sizes
from posttrain.trainers.rl_metrics import StepTimer, batch_metrics, peak_memory_gb
from posttrain.trainers.rl_run import RLRun, setup_run
from posttrain.trainers.rl_update import StepBatch, UpdateTargets, prepare_batch, scoring_pass, update_policy

OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# Under torchrun: metrics that are each rank's part of a total (the others are averaged over the ranks).
SUMMED_METRICS = frozenset({"num_samples", "dapo/kept_groups", "reward/unscorable", "tokens/rollout_per_s", "tokens/train_per_s",
                            "rollout/idle_forwards"})


# ----------------------------------------------------------------------------- one step


def _rollout_weights(run: RLRun) -> AbstractContextManager[Lockstep]:
    """The weights the engine runs on (see `Parallel.rollout`); one process: the model as it is."""
    return run.parallel.rollout() if run.parallel is not None else nullcontext(Lockstep.off())


def _advantages(run: RLRun, data: StepBatch, behaviour: Tensor, ref: Tensor | None,
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
    with _rollout_weights(run) as lockstep:  # FSDP2: whole weights, or layer by layer in lockstep
        batch, stats = collect_rollout(
            run.llm, run.source, cfg.rollout.prompts_per_step, run.params, run.specs, run.overlong,
            run.algo.dynamic_sampling, cfg.dapo.max_refill_rounds,
            shard=parallel.shard if sharded else None,
            seed_base=prompt_seed_base(cfg.train.seed, step) if cfg.rollout.seed_prompts else None,
            lockstep=lockstep,
        )
    timer.seconds["rollout"] = stats.rollout_s
    timer.seconds["reward"] = stats.reward_s
    metrics: dict[str, Any] = {"zero_variance_frac": stats.zero_variance_frac}
    if lockstep.active:  # engine forwards this rank ran only to take part in the others' gathers
        metrics["rollout/idle_forwards"] = lockstep.idle_forwards
    if run.algo.dynamic_sampling:
        metrics.update({"dapo/refill_rounds": stats.refill_rounds, "dapo/extra_prompts": stats.extra_prompts,
                        "dapo/dropped_groups": stats.dropped_groups,
                        "dapo/kept_groups": batch.num_groups if batch is not None else 0})
    metrics["tokens/rollout_per_s"] = stats.generated_tokens / max(stats.rollout_s, 1e-9)
    if batch is None:  # dynamic sampling left no group with a learning signal
        metrics.update({"skipped": 1, "time/step_s": time.perf_counter() - step_start, **timer.metrics()})
        return metrics
    metrics.update(batch_metrics(batch))
    data = prepare_batch(run, batch)
    ref = values = old = None
    if run.uses_reference:
        with timer("ref_pass"):
            if run.reference is not None:
                ref, _ = scoring_pass(run, data, run.reference, with_values=False)
            else:
                ref, _ = scoring_pass(run, data, run.model, with_values=False, base_only=True)
    if _needs_old_pass(run, batch.num_samples * world):
        with timer("old_pass"):
            old, values = scoring_pass(run, data, run.model, with_values=run.value_head is not None)
    if cfg.train.old_logprobs == "rollout":
        old = data.rollout_logprobs
    loss_mask = data.mask
    if run.value_head is not None:
        loss_mask = data.mask * (~torch.isnan(data.rewards)).float()[:, None]  # unscorable: out of PPO's loss
    with timer("advantage"):
        behaviour = old if old is not None else data.rollout_logprobs
        adv, returns, adv_metrics = _advantages(run, data, behaviour, ref, values, loss_mask)
    metrics.update(adv_metrics)
    targets = UpdateTargets(adv, loss_mask, old_logprobs=old, ref_logprobs=ref, old_values=values, returns=returns)
    with timer("update"):
        update_metrics, train_tokens = update_policy(run, step, data, targets)
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


def _evaluate(run: RLRun, step: int) -> dict[str, Any]:
    if not run.held_out:
        return {}
    start = time.perf_counter()
    max_tokens = run.cfg.eval.max_tokens or run.cfg.rollout.max_tokens
    # Under torchrun every rank evaluates every held-out prompt (greedy: the same answers everywhere), so the
    # ranks stay in step with no reduction; rank 0 writes.
    with _rollout_weights(run) as lockstep:
        metrics, samples = evaluate(run.llm, run.held_out, run.specs, max_tokens, run.cfg.reward.correct_threshold,
                                    lockstep=lockstep)
    metrics["time/eval_s"] = time.perf_counter() - start
    if not is_main():
        return metrics
    with open(run.run_dir / f"eval-step{step:05d}.jsonl", "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    tqdm.write(f"step {step}: held-out greedy accuracy {metrics['eval/accuracy']:.3f} "
               f"({len(run.held_out)} prompts, {metrics['time/eval_s']:.1f}s)")
    return metrics


def _save_final(run: RLRun) -> Path:
    # The PEFT adapter with LoRA / QLoRA, else an HF directory; the value head goes beside either.
    if run.parallel is not None and run.parallel.wrapped is not None:
        out = save_final_parallel(run.parallel, run.tokenizer, run.run_dir, base_model=run.cfg.model.name_or_path)
        if run.value_head is not None:
            head = run.parallel.whole(run.value_head)  # fsdp2: gathered on rank 0; ddp: the same on every rank
            if is_main():
                save_value_head(head, out)
            barrier()
        return out
    out = save_final_dir(run.model, run.tokenizer, run.run_dir, base_model=run.cfg.model.name_or_path)
    if run.value_head is not None:
        save_value_head(run.value_head, out)
    return out


# What the progress bar shows beside the loss, lr and tokens/s: {label: metric key}
HEADLINE = {"reward": "reward/mean", "acc": "eval/accuracy", "len": "response_len/mean", "s/step": "time/step_s"}


def _run_steps(run: RLRun, started: float, eval_s: float, desc: str) -> int:
    """`rl_step` from the run's start to train.max_steps through the shared step loop (bar, records, checkpoints),
    whose stop hook ends the run when the next step, the final evaluation (about `eval_s`) and the save no
    longer fit in train.max_minutes counted from `started`; returns the steps done. The periodic evaluations
    run inside the step (their metrics join its record); the final one is the caller's, after a stop too."""
    cfg = run.cfg
    budget_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes is not None else math.inf
    # What the budget keeps after the last step: the final evaluation (as long as the first, and a margin) and
    # the save. The stop rule leaves it out, and so does the progress bar's projection of the steps.
    reserve_s = eval_s * 1.2 + 10
    step_times: list[float] = []
    done = run.start_step

    def step(index: int) -> dict[str, Any]:
        nonlocal done
        metrics = rl_step(run, index + 1)
        done = index + 1
        step_times.append(metrics["time/step_s"])
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.max_steps:
            metrics.update(_evaluate(run, done))
        metrics["time/elapsed_min"] = (time.perf_counter() - started) / 60
        run.history.append(metrics)
        return metrics

    def out_of_time(steps_done: int) -> bool:
        elapsed = time.perf_counter() - started
        next_step = max(step_times[-3:]) if step_times else 0.0
        # the step, the final eval and the save fit; rank 0's clock decides for every rank
        if not broadcast_object(elapsed + next_step + reserve_s > budget_s):
            return False
        tqdm.write(f"time budget of {cfg.train.max_minutes} min reached after {steps_done} steps")
        return True

    run_steps(step, max_steps=cfg.train.max_steps, optimizer=run.optimizer, metrics=run.logger,
              save_every=cfg.train.save_every, save_fn=run.checkpointer.save, progress=cfg.log.progress and is_main(),
              desc=desc, postfix=HEADLINE, start_step=run.start_step, should_stop=out_of_time,
              budget_s=budget_s, started=started, reserve_s=reserve_s)
    return done


def train(cfg: RLConfig, command: str, *, model: nn.Module | None = None, tokenizer: Any = None) -> Path:
    """Run the RL loop to max_steps or the time budget; returns the run directory."""
    started = time.perf_counter()
    run = setup_run(cfg, command, model=model, tokenizer=tokenizer)
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "algorithm": run.algo.name}
    try:
        eval_s = 0.0
        if cfg.eval.before and run.held_out and run.start_step == 0:
            before = _evaluate(run, 0)
            eval_s = before["time/eval_s"]
            if run.logger is not None:
                run.logger.log(0, before)
            summary["accuracy_before"] = before["eval/accuracy"]
        step = _run_steps(run, started, eval_s, desc=f"{command} ({run.algo.name})")
        summary["steps"] = step
        if run.held_out:
            after = _evaluate(run, step)
            if run.logger is not None:
                run.logger.log(step, after)
            summary["accuracy_after"] = after["eval/accuracy"]
        if cfg.save_final:
            summary["final"] = str(_save_final(run))
        summary["minutes"] = round((time.perf_counter() - started) / 60, 2)
        if is_main():
            (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    finally:
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

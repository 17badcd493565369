"""The RL loop for the GRPO family and PPO, on the rollout engine over the live policy module.

One step:
  1. rollout   the engine samples G completions for each of P fresh prompts from the module being
               trained (no weight copy); rewards (NaN = unscorable), DAPO shaping / dynamic sampling
  2. passes    reference logprobs when kl.beta > 0 (a frozen copy, or the base with LoRA off);
               an "old" no-grad pass only when it is needed (see below)
  3. advantage the algorithm's estimator on the whole batch
  4. update    epochs x minibatches of the clipped policy loss (+ KL, entropy, value loss); after
               every optimizer step `llm.weights_updated()`, and the next rollout sees the new weights

The training forward packs each group as one row with its prompt computed once (`batch`), and
projects only completion positions through the LM head. `run` builds a run (`setup_run`),
`update` holds the passes and the update, `zero_advantage` leaves groups without signal out of it;
this module is the step (`train` is the loop around it).

pi_old, the denominator of the importance ratio (`train.old_logprobs`):
  - a single update per rollout (one epoch, one minibatch): the logprobs of the update's own forward,
    detached. The weights that sampled are the weights being differentiated, so this IS pi_old, and
    the ratio is exactly 1 with the policy gradient as its gradient; no extra pass.
  - several updates: a no-grad pass before the first update ("recompute"), or the engine's sampling
    logprobs ("rollout"), which come from the same weights through the paged kernel (they agree with
    the dense forward to ~1e-5 in fp32; bf16 kernels differ more, so recompute is the default).
  The engine's logprobs are always the behaviour policy: `train.off_policy` weighs each token's loss by
  min(pi_old / pi_engine, cap) (truncated IS) or masks it out of the band (masked IS), per token or per
  sequence, and on its own when the engine and the update compute in other dtypes; `mismatch/*` report the
  trainer-engine difference on the first update of every step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from posttrain.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, masked_mean
from posttrain.cpu_malloc import current_malloc_policy, return_free_memory
from posttrain.distributed.env import reduce_metrics
from posttrain.rollout.collect import collect_rollout, prompt_seed_base
from posttrain.rollout.generate import generate_groups
from posttrain.rollout.producer import ProducedBatch
from posttrain.rollout.tail_fill import TailFill
from posttrain.trainers.rl.async_rollout import AsyncRollout, StepPrompts
from posttrain.trainers.rl.config import batch_sizes
from posttrain.trainers.rl.metrics import StepTimer, batch_metrics, collection_metrics, peak_memory_gb
from posttrain.trainers.rl.ppo import ppo_advantages, whiten_over_ranks
from posttrain.trainers.rl.run import RLRun, rollout_weights
from posttrain.trainers.rl.update import StepBatch, UpdateTargets, prepare_batch, scoring_pass, update_policy

OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# Under torchrun: metrics that are each rank's part of a total (the others are averaged over the ranks).
SUMMED_METRICS = frozenset(
    {
        "num_samples",
        "dapo/kept_groups",
        "reward/unscorable",
        "tokens/rollout_per_s",
        "tokens/train_per_s",
        "rollout/idle_forwards",
    }
)


def _advantages(
    run: RLRun, data: StepBatch, behaviour: Tensor, ref: Tensor | None, values: Tensor | None, loss_mask: Tensor
) -> tuple[Tensor, Tensor | None, dict[str, float]]:
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
        adv, returns = ADVANTAGE_ESTIMATORS["reinforce_pp"](
            rewards, data.mask, gamma=1.0, per_token_kl=kl_tokens, kl_coef=cfg.kl.beta, turn_rewards=data.turn_rewards
        )  # (B, L), (B, L)
        if world > 1:
            # The estimator whitened over this rank's tokens only: whiten the returns again with the mean and
            # variance of every rank's scorable tokens, as one process whitens the whole batch.
            scorable = ~torch.isnan(rewards)  # (B,)
            adv = whiten_over_ranks(returns, data.mask.float() * scorable.unsqueeze(1))
        return adv, None, metrics
    ppo = cfg.ppo
    adv, returns = ppo_advantages(
        rewards,
        values,
        loss_mask,
        gamma=ppo.gamma,
        lam=ppo.lam,
        whiten=ppo.whiten_advantages and world == 1,
        per_token_kl=kl_tokens,
        kl_coef=cfg.kl.beta,
        turn_rewards=data.turn_rewards,
    )
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


def collect_step(run: RLRun, step: int, fill: TailFill | None = None) -> ProducedBatch:
    """The step's scored rollout batch and the collection's metrics (in async mode: run by the rollout thread;
    `fill`: its engine calls, which submit the next step's prompts into this step's tail, rollout/tail_fill.py)."""
    cfg, parallel = run.cfg, run.parallel
    admitted = fill.take(step) if fill is not None else None
    sharded = parallel is not None and parallel.wrapped is not None
    if isinstance(run.source, StepPrompts):
        run.source.begin_step(step)
    seeded = cfg.rollout.seed_prompts or cfg.rollout.mode == "async"  # async: never on thread timing
    with rollout_weights(run) as lockstep:  # FSDP2: whole weights, or layer by layer in lockstep
        batch, stats = collect_rollout(
            run.llm,
            run.source,
            cfg.rollout.prompts_per_step,
            run.params,
            run.specs,
            run.overlong,
            run.algo.dynamic_sampling,
            cfg.dapo.max_refill_rounds,
            shard=parallel.shard if sharded else None,
            seed_base=prompt_seed_base(cfg.train.seed, step) if seeded else None,
            lockstep=lockstep,
            generate=fill or run.episodes or generate_groups,
            admitted=admitted,
        )
    metrics = collection_metrics(stats, batch, run.algo.dynamic_sampling, run.episodes)
    if fill is not None:  # 1: this step's prompts were submitted during the previous step's tail
        metrics["async/tail_filled"] = float(admitted is not None)
    if lockstep.active:  # engine forwards this rank ran only to take part in the others' gathers
        metrics["rollout/idle_forwards"] = lockstep.idle_forwards
    return ProducedBatch(step, batch, stats, metrics)


def _step_done(run: RLRun, step: int, metrics: dict[str, Any]) -> None:
    """Async mode: the producer may go on past `step`; the busy / idle shares join the step's metrics."""
    if run.async_rollout is not None:
        metrics.update(run.async_rollout.step_done(step))


def rl_step(run: RLRun, step: int) -> dict[str, Any]:
    """Rollout, rewards, advantages, updates; returns the step's metrics."""
    cfg = run.cfg
    timer = StepTimer()
    step_start, cpu_start = time.perf_counter(), time.process_time()
    parallel = run.parallel
    sharded = parallel is not None and parallel.wrapped is not None
    world = parallel.world if parallel is not None else 1
    if run.async_rollout is None and cfg.rollout.mode == "async":  # started by the first step (of a resumed run too)
        run.async_rollout = AsyncRollout(run, step, lambda s, fill: collect_step(run, s, fill))
    if run.async_rollout is not None:
        produced, async_metrics = run.async_rollout.take(step)
    else:
        produced, async_metrics = collect_step(run, step), {}
    batch, stats = produced.batch, produced.stats
    timer.seconds["rollout"] = stats.rollout_s
    timer.seconds["reward"] = stats.reward_s
    metrics: dict[str, Any] = {**produced.metrics, **async_metrics}
    if batch is None:  # dynamic sampling left no group with a learning signal
        metrics.update({"skipped": 1, "time/step_s": time.perf_counter() - step_start, **timer.metrics()})
        _step_done(run, step, metrics)
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
    if run.device.type == "cpu" and current_malloc_policy() == "hold":
        # model.cpu_memory=keep leaves the process in the engine's `hold` (posttrain.cpu_malloc), which never
        # trims: without this, each step's update activations and rollout temporaries land in new holes and the
        # resident set climbs step after step (24 GiB by step 18 of examples/agent_guess_number_tools.yaml, with
        # ~2.6 GiB live between steps). Once a step, the free pages go back; the next step faults them in again.
        with timer("trim"):
            return_free_memory()
    metrics["policy_version"] = run.llm.policy_version
    metrics["rollout_policy_version"] = min(batch.policy_versions)
    _step_done(run, step, metrics)
    metrics["optimizer_steps"] = run.optimizer_steps
    metrics["time/step_s"] = time.perf_counter() - step_start
    # CPU seconds of the whole process (all threads): on a shared machine, wall time says more about the
    # neighbours than about the step; CPU time / threads approximates the step on an idle machine.
    metrics["time/step_cpu_s"] = time.process_time() - cpu_start
    metrics.update(timer.metrics())
    metrics.update(peak_memory_gb(run.device))
    if sharded:  # counts and throughputs add up over the ranks; means (over equal shares) average
        # env/*: per-episode rates a rank leaves out where none of its episodes met the case (env/finish/<reason>,
        # env/tool_calls/<tool>): 0 there, not absent
        metrics = reduce_metrics(metrics, SUMMED_METRICS, run.device, absent_is_zero=("env/",))
    return metrics

"""The RL run for the GRPO family and PPO: setup, the time-budgeted loop of `rl_step`s through the shared
step loop, the held-out evaluations before / during / after, and the final save (HF directory or PEFT
adapter, and the value head beside it)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from torch import nn
from tqdm.auto import tqdm

from posttrain.distributed.env import broadcast_object, is_main
from posttrain.envs import Environment
from posttrain.envs.tool_calls import ToolCallParser
from posttrain.errors import PosttrainError
from posttrain.rollout.episode_batch import EpisodeGroups, episode_metrics
from posttrain.rollout.evaluate import evaluate
from posttrain.rollout.generate import generate_groups
from posttrain.run_dir import final_dir
from posttrain.trainers.loop import run_steps
from posttrain.trainers.rl.best import BestModel
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig, RLConfig
from posttrain.trainers.rl.rollout_procs import ProcessRollout, join_rollout_link, serve_rollouts
from posttrain.trainers.rl.run import RLRun, rollout_weights, setup_run
from posttrain.trainers.rl.save import save_run_model
from posttrain.trainers.rl.step import rl_step


def _evaluate(run: RLRun, step: int, best: BestModel | None) -> dict[str, Any]:
    """The held-out greedy evaluation at `step` (its samples in <run>/eval-stepN.jsonl); with `best`
    (eval.save_best) a better accuracy than any before writes <run>/best."""
    if not run.held_out:
        return {}
    start = time.perf_counter()
    max_tokens = run.cfg.eval.max_tokens or run.cfg.rollout.max_tokens
    # Under torchrun every rank evaluates every held-out prompt (greedy: the same answers everywhere), so the
    # ranks stay in step with no reduction; rank 0 writes.
    # Episodes: the same runner as the rollout's, greedy, one episode per held-out row, with its own log.
    episodes = EpisodeGroups(run.episodes.options) if run.episodes is not None else None
    engine_alone = run.async_rollout.producer.exclusive() if run.async_rollout is not None else nullcontext()
    with engine_alone, rollout_weights(run) as lockstep:
        metrics, samples = evaluate(
            run.llm,
            run.held_out,
            run.specs,
            max_tokens,
            run.cfg.reward.correct_threshold,
            lockstep=lockstep,
            generate=episodes or generate_groups,
        )
    if episodes is not None:
        metrics.update({f"eval/{key}": value for key, value in episode_metrics(episodes.take_log()).items()})
    metrics["time/eval_s"] = time.perf_counter() - start  # the evaluation alone: the budget's reserve reads it
    if best is not None and best.offer(step, metrics["eval/accuracy"]):
        metrics["eval/best_saved"] = 1.0
    if not is_main():
        return metrics
    with open(run.run_dir / f"eval-step{step:05d}.jsonl", "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    tqdm.write(
        f"step {step}: held-out greedy accuracy {metrics['eval/accuracy']:.3f} "
        f"({len(run.held_out)} prompts, {metrics['time/eval_s']:.1f}s)"
    )
    return metrics


# What the progress bar shows beside the loss, lr and tokens/s: {label: metric key}
HEADLINE = {"reward": "reward/mean", "acc": "eval/accuracy", "len": "response_len/mean", "s/step": "time/step_s"}


def _run_steps(run: RLRun, started: float, eval_s: float, desc: str, best: BestModel | None) -> int:
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
            metrics.update(_evaluate(run, done, best))
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

    run_steps(
        step,
        max_steps=cfg.train.max_steps,
        optimizer=run.optimizer,
        metrics=run.logger,
        save_every=cfg.train.save_every,
        save_fn=run.checkpointer.save,
        progress=cfg.log.progress and is_main(),
        desc=desc,
        postfix=HEADLINE,
        start_step=run.start_step,
        should_stop=out_of_time,
        budget_s=budget_s,
        started=started,
        reserve_s=reserve_s,
    )
    return done


def train(cfg: RLConfig, command: str, *, model: nn.Module | None = None, tokenizer: Any = None, **env: Any) -> Path:
    """Run the RL loop to max_steps or the time budget; returns the run directory. `env`: setup_run's make_env /
    parser (an environment given in Python)."""
    started = time.perf_counter()
    link = None
    if cfg.dist.rollout_ranks:  # rank 0 trains, the last ranks only generate (rollout_procs)
        ctx, link = join_rollout_link(cfg)
        if link.is_rollout:
            return serve_rollouts(cfg, ctx, link, model=model, tokenizer=tokenizer, **env)
    run = setup_run(cfg, command, model=model, tokenizer=tokenizer, **env)
    if link is not None:  # the trainer takes its batches from the rollout processes from the first step on
        run.async_rollout = ProcessRollout(run, link)
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "algorithm": run.algo.name}
    best = BestModel(run.run_dir, lambda out: save_run_model(run, out)) if cfg.eval.save_best else None
    try:
        eval_s = 0.0
        if cfg.eval.before and run.held_out and run.start_step == 0:
            before = _evaluate(run, 0, best)
            eval_s = before["time/eval_s"]
            if run.logger is not None:
                run.logger.log(0, before)
            summary["accuracy_before"] = before["eval/accuracy"]
        try:
            step = _run_steps(run, started, eval_s, desc=f"{command} ({run.algo.name})", best=best)
        finally:  # async: the rollout thread stops (after its batch in flight) before the engine is used again
            if run.async_rollout is not None:
                run.async_rollout.close()
                run.async_rollout = None
        summary["steps"] = step
        if run.held_out:
            after = _evaluate(run, step, best)
            if run.logger is not None:
                run.logger.log(step, after)
            summary["accuracy_after"] = after["eval/accuracy"]
        if cfg.save_final:
            summary["final"] = str(save_run_model(run, final_dir(run.run_dir), export=True))
        if best is not None and best.step is not None:
            summary["best"] = {"step": best.step, "accuracy": best.accuracy, "dir": str(best.dir)}
        summary["minutes"] = round((time.perf_counter() - started) / 60, 2)
        if is_main():
            (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    finally:
        if run.logger is not None:
            run.logger.close()
    if "accuracy_after" in summary and is_main():
        before_text = f"{summary['accuracy_before']:.1%} -> " if "accuracy_before" in summary else ""
        print(
            f"held-out greedy accuracy: {before_text}{summary['accuracy_after']:.1%} "
            f"({summary['steps']} steps, {summary['minutes']} min); run: {run.run_dir}"
        )
        if "best" in summary:
            print(
                f"best held-out accuracy {summary['best']['accuracy']:.1%} at step {summary['best']['step']}: "
                f"{summary['best']['dir']}"
            )
    return run.run_dir


def train_grpo(
    cfg: GRPOConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    make_env: Callable[[], Environment] | None = None,
    parser: ToolCallParser | None = None,
) -> Path:
    """Run `posttrain grpo` from a GRPOConfig (any GRPO-family `algorithm`); returns the run directory.
    `make_env` / `parser`: the `env:` section's environment factory and tool-call parser, given in Python."""
    if not isinstance(cfg, GRPOConfig):
        raise PosttrainError(f"train_grpo needs a GRPOConfig, got {type(cfg).__name__} (PPO: train_ppo)")
    return train(cfg, "grpo", model=model, tokenizer=tokenizer, make_env=make_env, parser=parser)


def train_ppo(
    cfg: PPOConfig,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    make_env: Callable[[], Environment] | None = None,
    parser: ToolCallParser | None = None,
) -> Path:
    """Run `posttrain ppo` from a PPOConfig; returns the run directory. `make_env` / `parser`: as in train_grpo."""
    if not isinstance(cfg, PPOConfig):
        raise PosttrainError(f"train_ppo needs a PPOConfig, got {type(cfg).__name__} (GRPO family: train_grpo)")
    return train(cfg, "ppo", model=model, tokenizer=tokenizer, make_env=make_env, parser=parser)

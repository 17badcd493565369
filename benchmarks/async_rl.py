"""Asynchronous RL against sync, same wall time each: steps per hour and held-out accuracy at the end.

The demo configuration (`posttrain grpo`: SmolLM2-135M-Instruct at `model.dtype: auto`, which is bf16 on a CPU
with fast bf16 and fp32 otherwise, the same for every run; `--set model.dtype=float32` pins it; the arithmetic
task, 8 prompts x 8 samples) is trained `--minutes` of wall time (the run's `train.max_minutes`) three times, one
after the other in this process: `rollout.mode=sync`, then `rollout.mode=async` with `rollout.max_staleness` 1
and 2. Every run seeds its prompts (`rollout.seed_prompts`), skips the held-out evaluation before training (the
runs differ only in how they train) and ends with the held-out greedy evaluation of the demo (100 problems).

Two cases (`--cases`):
  plain        the task's reward (numeric_match)
  slow_reward  the same reward behind a 0.5 s wait per call (`--latency`), as a sandboxed code reward or a remote
               judge would add: one call per step's batch, the latency async mode should hide behind the update

Steps per hour = steps / the summed wall time of the steps (`time/step_s`: setup and evaluations left out; the
first step of each run too, which carries one-time costs).
Per run it prints one line; the last line is one JSON object:
  {"minutes": ..., "sync_steps_per_hour", "async_steps_per_hour", "async_k2_steps_per_hour",
   "sync_accuracy", "async_accuracy", "async_k2_accuracy", "speedup", "speedup_k2",
   "slow_reward_sync_steps_per_hour", ... (the same keys prefixed slow_reward_ for the second case),
   "async_staleness_mean", "async_rollout_busy_frac", "async_update_busy_frac", ..., "load_before", "load_after"}
(`async_*` is k = 1, `async_k2_*` k = 2; `speedup` = async / sync steps per hour.) The goal of issue 25: speedup
>= 1.3 at k = 1 with async_accuracy >= sync_accuracy. Quote it with the load averages: on a shared machine the
neighbours move absolute figures a lot; ratios of runs taken one after the other less so.

    .venv/bin/python benchmarks/async_rl.py                       # 2 cases x 3 runs x 10 minutes: ~65 minutes
    .venv/bin/python benchmarks/async_rl.py --minutes 1 --cases plain --set data.eval_size=20   # a smoke run
Any `--set key=value` is passed to every run as a config override (e.g. a smaller model or batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUNS = (("sync", "sync", 0), ("async", "async", 1), ("async_k2", "async", 2))  # (name, rollout.mode, max_staleness)
SLOW_REWARD = """
import time

from posttrain.rewards.answers import numeric_match


def slow_numeric_match(prompts, completions, answer, **kwargs):
    time.sleep({latency})  # one call per batch: a sandbox or a remote judge
    return numeric_match(prompts, completions, answer, **kwargs)
"""


def run_one(out: Path, mode: str, staleness: int, minutes: float, extra: list[str]) -> dict[str, Any]:
    from posttrain.config import load_config
    from posttrain.trainers.rl import train_grpo
    from posttrain.trainers.rl.config import GRPOConfig

    overrides = [
        f"out={out}",
        f"train.max_minutes={minutes}",
        f"rollout.mode={mode}",
        f"rollout.max_staleness={staleness}",
        "rollout.seed_prompts=true",
        "eval.before=false",
        "log.progress=false",
        "save_final=false",
        *extra,
    ]
    train_grpo(load_config(GRPOConfig, None, overrides))
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time/step_s" in r]
    timed = steps[1:] or steps  # the first step carries one-time costs (the engine's first wave, kernel loads)
    step_s = sum(r["time/step_s"] for r in timed)
    result = {
        "steps": len(steps),
        "steps_per_hour": 3600 * len(timed) / step_s if step_s else 0.0,
        "accuracy": summary.get("accuracy_after"),
    }
    for key in ("async/staleness_mean", "async/rollout_busy_frac", "async/update_busy_frac", "async/stale_dropped"):
        values = [r[key] for r in steps if key in r]
        if values:
            result[key.replace("/", "_")] = sum(values) / len(values)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="wall time of each run (train.max_minutes)")
    parser.add_argument("--cases", default="plain,slow_reward", help="plain, slow_reward or both (comma-separated)")
    parser.add_argument("--latency", type=float, default=0.5, help="slow_reward: seconds of wait per reward call")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"plain", "slow_reward"}
    if unknown:
        parser.error(f"--cases: unknown {', '.join(sorted(unknown))} (plain, slow_reward)")
    root = Path(args.out or tempfile.mkdtemp(prefix="async-rl-"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"minutes": args.minutes, "load_before": list(os.getloadavg())}
    for case in cases:
        extra = list(args.set)
        prefix = "" if case == "plain" else "slow_reward_"
        if case == "slow_reward":
            reward = root / "slow_reward.py"
            reward.write_text(SLOW_REWARD.format(latency=args.latency))
            extra.append(f"reward.functions=[{reward}:slow_numeric_match]")
        for name, mode, staleness in RUNS:
            started = time.perf_counter()
            result = run_one(root / f"{case}-{name}", mode, staleness, args.minutes, extra)
            print(
                f"{case:12s} {name:9s} {result['steps']:4d} steps, {result['steps_per_hour']:7.1f} steps/h, "
                f"held-out accuracy {result['accuracy']}, {time.perf_counter() - started:.0f} s",
                flush=True,
            )
            report[f"{prefix}{name}_steps_per_hour"] = result["steps_per_hour"]
            report[f"{prefix}{name}_accuracy"] = result["accuracy"]
            report[f"{prefix}{name}_steps"] = result["steps"]
            for key, value in result.items():
                if key.startswith("async_"):
                    report[f"{prefix}{name}_{key.removeprefix('async_')}"] = value
        sync_rate = report[f"{prefix}sync_steps_per_hour"] or float("nan")
        report[f"{prefix}speedup"] = report[f"{prefix}async_steps_per_hour"] / sync_rate
        report[f"{prefix}speedup_k2"] = report[f"{prefix}async_k2_steps_per_hour"] / sync_rate
    report["load_after"] = list(os.getloadavg())
    print(json.dumps(report))


if __name__ == "__main__":
    main()

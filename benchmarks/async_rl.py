"""Asynchronous RL against sync, same wall time each: steps per hour and held-out accuracy, alternated rounds.

Each run is `posttrain grpo` trained `--minutes` of wall time (the run's `train.max_minutes`), in this process:
`rollout.mode=sync`, and the `--modes` chosen (default: `rollout.mode=async` with `rollout.max_staleness` 1 and 2;
`async_fill` / `async_k2_fill`: the same with `rollout.async_fill=0.5`). Every run seeds its prompts
(`rollout.seed_prompts`), skips the held-out evaluation before training (the runs differ only in how they train)
and ends with the config's held-out greedy evaluation. All runs of one invocation share the precision
(`--precision fp32`, the default: `model.dtype=float32`; `bf16`: `model.dtype=auto`, refused on a CPU without
fast bf16), so sync and async compute alike.

Cases (`--cases`):
  plain         the single-turn demo (arithmetic, 8 prompts x 8 samples) with its reward (numeric_match)
  slow_reward   the same reward behind a `--latency` s wait per call (0.5), as a sandbox or a remote judge adds:
                one call per step's batch
  tool_latency  the multi-turn word-problems agent (examples/agent_word_problems.yaml, from `--tool-start`)
                with `env.tool_latency_s` 0 and each of `--tool-latency` (0.5, 2): every answered turn of every
                episode waits that long without using the CPU, as a remote tool or sandbox would (env.workers 48:
                every episode in flight may wait at once)

Noise: every run of the invocation (case x setting x mode) is one side of `alternation.alternate`, `--rounds`
times (default 2), in order in even rounds and reversed in odd ones; the figures are medians over the rounds,
and each async/sync ratio comes with its per-round spread (`ratio_min`, `ratio_max`).

Steps per hour = steps / the summed wall time of the steps (`time/step_s`: setup and evaluations left out; the
first step of each run too, which carries one-time costs). The last line is one JSON object:
  {"benchmark": "async_rl", "minutes", "rounds", "precision", "sides": {...dtype, threads, versions},
   "runs": {"plain/sync": {"steps_per_hour": median, "steps_per_hour_rounds": [...], "accuracy": median,
            "accuracy_rounds": [...], "staleness_mean": ..., ...}, "plain/async": ..., "plain/async_k2": ...,
            "tool_latency_0.5/sync": ..., ...},
   "speedup": {"plain/async": ratio_summary(async, sync), "plain/async_k2": ..., ...},
   "retained": {"tool_latency_0.5/async": steps/h with the latency / steps/h without it, ...},
   "load_before", "load_after"}
The goal of issue 44: async `retained` >= 0.8 at each tool latency (async hides >= 80% of it) with held-out
accuracy no lower than sync's; of issue 25: plain `speedup` >= 1.3 at k = 1.

    .venv/bin/python benchmarks/async_rl.py                                   # plain, slow_reward; 2 rounds x 10 min
    .venv/bin/python benchmarks/async_rl.py --cases tool_latency --minutes 5  # needs runs/word-problems-sft/final
    .venv/bin/python benchmarks/async_rl.py --cases tool_latency --modes sync,async_fill,async_k2_fill
    .venv/bin/python benchmarks/async_rl.py --minutes 1 --rounds 1 --cases plain --set data.eval_size=20  # smoke
Any `--set key=value` is passed to every run as a config override. On a 2-core CPU the rollout and the update
share the same two cores, so async can hide waits (rewards, tools) but gains little on compute alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alternation import alternate, ratio_summary  # noqa: E402
from matching import COMPUTE_NAMES, PRECISION_ARGUMENT, posttrain_model_dtype, side  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# name -> (rollout.mode, rollout.max_staleness, overrides); the *_fill modes start the next steps' prompts or episodes
# while this step's still run or wait on tools (rollout.async_fill, rollout/episode_fill.py)
MODES: dict[str, tuple[str, int, list[str]]] = {
    "sync": ("sync", 0, []),
    "async": ("async", 1, []),
    "async_k2": ("async", 2, []),
    "async_fill": ("async", 1, ["rollout.async_fill=0.5"]),
    "async_k2_fill": ("async", 2, ["rollout.async_fill=0.5"]),
}
DEFAULT_MODES = "sync,async,async_k2"
# tool_latency: environment workers enough for every episode in flight (3 steps of 16) to wait at once, as on a
# remote service that serves its callers concurrently (a waiting episode holds a worker: posttrain/envs/latency.py)
TOOL_WORKERS = 48
CASES = ("plain", "slow_reward", "tool_latency")
TOOL_CONFIG = ROOT / "examples" / "agent_word_problems.yaml"
SLOW_REWARD = """
import time

from posttrain.rewards.answers import numeric_match


def slow_numeric_match(prompts, completions, answer, **kwargs):
    time.sleep({latency})  # one call per batch: a sandbox or a remote judge
    return numeric_match(prompts, completions, answer, **kwargs)
"""
ASYNC_KEYS = ("async/staleness_mean", "async/rollout_busy_frac", "async/update_busy_frac", "async/stale_dropped")


def run_one(out: Path, config: Path | None, mode: str, staleness: int, minutes: float, extra: list[str]) -> dict:
    """One training run; its steps, steps per hour, held-out accuracy and mean async metrics."""
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
        "eval.every=0",
        "log.progress=false",
        "save_final=false",
        *extra,
    ]
    train_grpo(load_config(GRPOConfig, config, overrides))
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
    for key in ASYNC_KEYS:
        values = [r[key] for r in steps if key in r]
        if values:
            result[key.removeprefix("async/")] = sum(values) / len(values)
    return result


def settings(cases: list[str], args: argparse.Namespace, root: Path) -> dict[str, tuple[Path | None, list[str]]]:
    """label -> (config file or None for the demo, overrides) for every setting of the chosen cases."""
    precision = [f"model.dtype={posttrain_model_dtype(args.precision)}"]
    found: dict[str, tuple[Path | None, list[str]]] = {}
    for case in cases:
        if case == "plain":
            found["plain"] = (None, precision + args.set)
        elif case == "slow_reward":
            reward = root / "slow_reward.py"
            reward.write_text(SLOW_REWARD.format(latency=args.latency))
            found["slow_reward"] = (None, [*precision, f"reward.functions=[{reward}:slow_numeric_match]", *args.set])
        else:
            start = [f"model.name_or_path={args.tool_start}"] if args.tool_start else []
            for latency in (0.0, *args.tool_latency):
                overrides = [*precision, *start, f"env.tool_latency_s={latency}", f"env.workers={TOOL_WORKERS}"]
                overrides += args.set
                found[f"tool_latency_{latency:g}"] = (TOOL_CONFIG, overrides)
    return found


def median_of(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def summarize(results: dict[str, list[dict]]) -> dict[str, Any]:
    """The JSON line's runs, speedups and retained rates from every run's rounds."""
    runs: dict[str, dict] = {}
    for name, rounds in results.items():
        entry = {
            "steps_per_hour": median_of(rounds, "steps_per_hour"),
            "steps_per_hour_rounds": [round(r["steps_per_hour"], 2) for r in rounds],
            "steps_rounds": [r["steps"] for r in rounds],
            "accuracy": median_of(rounds, "accuracy"),
            "accuracy_rounds": [r["accuracy"] for r in rounds],
        }
        for key in ASYNC_KEYS:
            short = key.removeprefix("async/")
            if any(short in r for r in rounds):
                entry[short] = median_of(rounds, short)
        runs[name] = entry
    speedup, retained = {}, {}
    for name in results:
        label, mode = name.rsplit("/", 1)
        if mode != "sync":
            rates = [r["steps_per_hour"] for r in results[name]]
            speedup[name] = ratio_summary(rates, [r["steps_per_hour"] for r in results[f"{label}/sync"]])
        if label.startswith("tool_latency_") and label != "tool_latency_0":
            retained[name] = round(runs[name]["steps_per_hour"] / runs[f"tool_latency_0/{mode}"]["steps_per_hour"], 3)
    return {"runs": runs, "speedup": speedup, "retained": retained}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="wall time of each run (train.max_minutes)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every run, alternated (default 2)")
    parser.add_argument("--cases", default="plain,slow_reward", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--latency", type=float, default=0.5, help="slow_reward: seconds of wait per reward call")
    parser.add_argument(
        "--tool-latency", type=float, nargs="+", default=[0.5, 2.0], help="tool_latency: env.tool_latency_s values"
    )
    parser.add_argument(
        "--tool-start", default="runs/word-problems-sft/final", help="tool_latency: the model to start from"
    )
    parser.add_argument(
        "--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)} (sync always runs)"
    )
    parser.add_argument("--precision", **PRECISION_ARGUMENT)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (choose from {', '.join(CASES)})")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    modes = ["sync", *[m for m in modes if m != "sync"]]  # the ratios' baseline
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if any(latency <= 0 for latency in args.tool_latency):
        parser.error("--tool-latency: each value must be > 0 (the 0 s baseline always runs)")
    if "tool_latency" in cases and args.tool_start and not Path(args.tool_start).exists():
        parser.error(
            f"--tool-start {args.tool_start}: not found (run `posttrain sft examples/agent_word_problems_sft.yaml`)"
        )
    root = Path(args.out or tempfile.mkdtemp(prefix="async-rl-"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "async_rl",
        "minutes": args.minutes,
        "rounds": args.rounds,
        "precision": args.precision,
        "modes": {name: MODES[name] for name in modes},
        "sides": {"posttrain": side(COMPUTE_NAMES[args.precision], torch.get_num_threads())},
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }
    results: dict[str, list[dict]] = {}
    sides: dict[str, Callable[[], float]] = {}
    for label, (config, overrides) in settings(cases, args, root).items():
        for name in modes:
            mode, staleness, mode_overrides = MODES[name]
            key = f"{label}/{name}"
            results[key] = []

            def one(
                key=key, config=config, overrides=overrides + mode_overrides, mode=mode, staleness=staleness
            ) -> float:  # noqa: ANN001
                out = root / f"{key.replace('/', '-')}-{len(results[key]) + 1}"
                result = run_one(out, config, mode, staleness, args.minutes, overrides)
                results[key].append(result)
                print(f"{key:28s} {result['steps']:4d} steps, accuracy {result['accuracy']}", file=sys.stderr)
                return result["steps_per_hour"]

            sides[key] = one
    alternate(sides, args.rounds)
    report.update(summarize(results))
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report))


if __name__ == "__main__":
    main()

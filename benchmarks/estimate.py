"""`posttrain estimate` against measured peak memory: short real runs of SFT (full and LoRA), DPO and GRPO on
the default model, each in its own process, peak RSS from the kernel (os.wait4's ru_maxrss).

What is compared:
- measured: the peak resident set of the whole `posttrain sft|grpo` process, under both settings of
  `model.cpu_memory` (posttrain.cpu_malloc): `release` (the default: while training, freed blocks of 128 KiB
  or more go back to the OS; the rollout engine holds its memory while it generates) and `keep` (glibc as it
  comes, which keeps freed activation-sized buffers, below its adaptive mmap threshold of up to 32 MiB,
  resident as heap holes; the engine then holds for the rest of the process once it starts). Under `keep`
  RSS is the live tensors plus that slack; under `release` it tracks the live tensors, which is what the
  estimate counts. The logged step times of both settings are reported too (the price of `release`).
- estimate: `estimate_memory` for the shapes each run actually had, maximised over its micro-batches,
  plus the runtime overhead term, measured here once as the peak RSS of a process that imports torch and
  posttrain's trainers and loads the default tokenizer (what a training process holds before any model
  tensor). SFT shapes come from replaying the trainer's own batching (batch_stream + length_groups, the
  same seed), checked against the token counts the run logged; DPO's from replaying its pair batches (the
  same pairs, batch_stream and 2B-row padding); GRPO shapes come from the run's metrics
  (samples, mean response length, trained tokens) and the engine's KV-pool sizing rule.
- time: the estimate's step seconds at the CPU default throughput against the logged step time
  (informative only: the machine is shared).

    OMP_NUM_THREADS=1 python benchmarks/estimate.py           # one JSON line at the end
    python benchmarks/estimate.py --cases sft-full grpo --allocators release
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"
HH = ROOT / "examples" / "data" / "hh-rlhf" / "harmless-pairs.jsonl.gz"
CASES = ("sft-full", "sft-lora", "dpo", "grpo")
ALLOCATORS = ("release", "keep")  # the values of model.cpu_memory
OVERHEAD_PROBE = (
    "import torch, posttrain.trainers.sft, posttrain.trainers.rl\n"
    "from posttrain.models.hub import load_tokenizer, resolve_model_path\n"
    "load_tokenizer(resolve_model_path({model!r}))\n"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--sft-steps", type=int, default=3)
    parser.add_argument("--sft-rows", type=int, default=64, help="GSM8K rows read (a small slice)")
    parser.add_argument("--dpo-steps", type=int, default=3)
    parser.add_argument("--dpo-rows", type=int, default=64, help="hh-rlhf pairs read (a small slice)")
    parser.add_argument("--grpo-steps", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument(
        "--allocators",
        nargs="+",
        choices=ALLOCATORS,
        default=list(ALLOCATORS),
        help="measure under these allocator settings (see above)",
    )
    return parser.parse_args()


def peak_rss(argv: list[str], log: Path) -> tuple[int, float]:
    """Run argv to completion; (its peak RSS in bytes, wall seconds). Raises with the log tail on failure."""
    env = dict(os.environ)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        # wait4 gives this child's own rusage; RUSAGE_CHILDREN would be the max over all children so far.
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}:\n{tail}")
    maxrss = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024  # Linux: KiB
    return maxrss, time.perf_counter() - start


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- SFT


def sft_overrides(args: argparse.Namespace, out: Path, lora: bool) -> list[str]:
    overrides = [
        str(ROOT / "examples" / "sft_gsm8k.yaml"),
        f"data.path={GSM8K}",
        f"data.max_rows={args.sft_rows}",
        "data.eval_fraction=0",
        f"train.max_steps={args.sft_steps}",
        "train.progress=false",
        f"out={out}",
    ]
    return overrides + (["lora.r=16"] if lora else [])


def sft_micro_batches(overrides: list[str], steps: int) -> list[list[dict[str, int]]]:
    """Per step, the trainer's micro-batches as {rows, width, targets, tokens}: the same data, batch_stream
    and length_groups as `start_sft`, so the same padded shapes."""
    import torch

    from posttrain.config import parse_cli_config
    from posttrain.data.collate import length_groups
    from posttrain.models.hub import load_tokenizer, resolve_model_path
    from posttrain.trainers.loop import batch_stream
    from posttrain.trainers.sft import SFTConfig, default_group_cost, load_sft_data

    cfg = parse_cli_config(SFTConfig, overrides)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.name_or_path))
    units, _, _ = load_sft_data(cfg, tokenizer)
    stream = batch_stream(units, cfg.train.batch_size, seed=cfg.train.seed)
    cost = cfg.train.group_cost_tokens
    cost = default_group_cost(torch.device("cpu")) if cost is None else cost
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(cfg.train.grad_accum):
            batch = next(stream)
            for group in length_groups([len(u) for u in batch], cost):
                rows = [batch[i] for i in group]
                micro.append(
                    {
                        "rows": len(rows),
                        "width": max(len(u) for u in rows),
                        "targets": sum(u.num_targets for u in rows),
                        "tokens": sum(len(u) for u in rows),
                    }
                )
        out.append(micro)
    return out


def sft_estimate(arch: Any, steps: list[list[dict[str, int]]], lora: bool, overhead: int) -> dict[str, Any]:
    """The largest estimate over all micro-batches. A micro-batch after the first of its step runs its
    backward with the earlier micro-batches' gradients in place (grad_accum > 1 in the estimator)."""
    from posttrain.estimate import TrainingSetup, estimate_memory

    best: dict[str, Any] = {}
    for micro in steps:
        for index, mb in enumerate(micro):
            prompt = mb["width"] - math.ceil(mb["targets"] / mb["rows"])
            setup = TrainingSetup(
                method="lora" if lora else "full",
                batch=mb["rows"],
                seq_len=mb["width"],
                prompt_len=prompt,
                grad_accum=1 if index == 0 else 2,
                overhead_bytes=overhead,
            )
            est = estimate_memory(arch, setup)
            if est.total_bytes > best.get("total_bytes", -1):
                best = {**est.as_dict(), "shape": {**mb, "prompt_len": prompt, "index_in_step": index}, "setup": setup}
    return best


def run_sft(args: argparse.Namespace, arch: Any, overheads: dict[str, int], tmp: Path, lora: bool) -> dict[str, Any]:
    from posttrain.estimate import estimate_time

    name = "sft-lora" if lora else "sft-full"
    measured, logged, step_time = {}, {}, {}
    for allocator in args.allocators:
        out = tmp / f"{name}-{allocator}"
        overrides = sft_overrides(args, out, lora) + [f"model.cpu_memory={allocator}"]
        measured[allocator], _ = peak_rss(
            [sys.executable, "-m", "posttrain", "sft", *overrides], tmp / f"{out.name}.log"
        )
        metrics = [r for r in read_jsonl(out / "metrics.jsonl") if "time/step_s" in r]
        logged[allocator] = [int(r["tokens"]) for r in metrics]
        step_time[allocator] = round(metrics[-1]["time/step_s"], 2)
    steps = sft_micro_batches(overrides, args.sft_steps)
    replayed = [sum(mb["tokens"] for mb in micro) for micro in steps]
    est = sft_estimate(arch, steps, lora, overheads[args.allocators[-1]])
    # Time: every micro-batch of the last step (the first steps include warm-up), at the CPU default.
    setups = [
        dataclasses.replace(
            est["setup"],
            batch=mb["rows"],
            seq_len=mb["width"],
            grad_accum=1,
            prompt_len=mb["width"] - math.ceil(mb["targets"] / mb["rows"]),
        )
        for mb in steps[-1]
    ]
    seconds = sum(estimate_time(arch, s, 0, 0.06, 20.0).step_seconds for s in setups)
    return _case(
        name,
        est,
        measured,
        overheads,
        args.tolerance,
        {
            "replay_matches_logged_tokens": all(replayed == t for t in logged.values()),
            "tokens_per_step": replayed,
            "step_seconds_estimate": round(seconds, 2),
            "step_seconds_measured": step_time,
        },
    )


# ----------------------------------------------------------------------------- DPO


def dpo_overrides(args: argparse.Namespace, out: Path, allocator: str) -> list[str]:
    return [
        str(ROOT / "examples" / "dpo_hh.yaml"),
        f"data.path={HH}",
        f"data.max_rows={args.dpo_rows}",
        "data.eval_fraction=0",
        "train.eval_every=0",
        f"train.max_steps={args.dpo_steps}",
        "train.progress=false",
        f"out={out}",
        f"model.cpu_memory={allocator}",
    ]


def dpo_micro_batches(overrides: list[str], steps: int) -> list[list[dict[str, int]]]:
    """Per step, the trainer's micro-batches as {pairs, width, targets, tokens}: the same pairs, batch_stream,
    regrouping by length and collate_pairs as `train_dpo` (one packed row per pair, the prompt once and both
    completions without their last token, padded to the longest row)."""
    from posttrain.config import parse_cli_config
    from posttrain.data.preference_pairs import load_pairs
    from posttrain.models.hub import load_tokenizer, resolve_model_path
    from posttrain.trainers.loop import batch_stream
    from posttrain.trainers.preference.dpo import DPOConfig
    from posttrain.trainers.preference.logps import by_length, collate_pairs

    cfg = parse_cli_config(DPOConfig, overrides)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.name_or_path))
    pairs = load_pairs(cfg.data, tokenizer, cfg.train.seed).train
    stream = batch_stream(range(len(pairs)), cfg.train.batch_size, seed=cfg.train.seed)
    out = []
    for _ in range(steps):
        micro = []
        for idx in by_length([next(stream) for _ in range(cfg.train.grad_accum)], pairs):
            packed = collate_pairs([pairs[i] for i in idx], tokenizer.pad_token_id or 0)
            micro.append(
                {
                    "pairs": len(idx),
                    "width": packed.input_ids.shape[1],
                    "targets": int(packed.completion_mask.sum()),
                    "tokens": packed.num_input_tokens,
                }
            )
        out.append(micro)
    return out


def run_dpo(args: argparse.Namespace, arch: Any, overheads: dict[str, int], tmp: Path) -> dict[str, Any]:
    """The default reference=precompute: its table is made before training, so no reference term."""
    from posttrain.estimate import TrainingSetup, estimate_memory

    measured, step_time = {}, {}
    for allocator in args.allocators:
        out = tmp / f"dpo-{allocator}"
        overrides = dpo_overrides(args, out, allocator)
        measured[allocator], _ = peak_rss(
            [sys.executable, "-m", "posttrain", "dpo", *overrides], tmp / f"{out.name}.log"
        )
        metrics = [r for r in read_jsonl(out / "metrics.jsonl") if "time/step_s" in r]
        step_time[allocator] = round(metrics[-1]["time/step_s"], 2)
    best: dict[str, Any] = {}
    for micro in dpo_micro_batches(overrides, args.dpo_steps):
        for index, mb in enumerate(micro):
            # N = 2B (L - P) targets and a packed row of P + 2 (L - P - 1) tokens: solve for P and L
            completion = math.ceil(mb["targets"] / (2 * mb["pairs"]))
            prompt = mb["width"] - 2 * (completion - 1)
            setup = TrainingSetup(
                trainer="dpo",
                batch=mb["pairs"],
                seq_len=prompt + completion,
                prompt_len=prompt,
                grad_accum=1 if index == 0 else 2,
                overhead_bytes=overheads[args.allocators[-1]],
            )
            est = estimate_memory(arch, setup)
            if est.total_bytes > best.get("total_bytes", -1):
                best = {**est.as_dict(), "shape": {**mb, "prompt_len": prompt, "index_in_step": index}}
    return _case("dpo", best, measured, overheads, args.tolerance, {"step_seconds_measured": step_time})


# ----------------------------------------------------------------------------- GRPO


def run_grpo(args: argparse.Namespace, arch: Any, overheads: dict[str, int], tmp: Path) -> dict[str, Any]:
    from posttrain.estimate import TrainingSetup, estimate_memory, estimate_time
    from posttrain.trainers.rl.config import GRPOConfig

    measured, records_by = {}, {}
    for allocator in args.allocators:
        out = tmp / f"grpo-{allocator}"
        overrides = [
            f"train.max_steps={args.grpo_steps}",
            "data.eval_size=0",
            "log.progress=false",
            "save_final=false",
            f"out={out}",
            f"model.cpu_memory={allocator}",
            # Every group through the update, as in a step where each has a reward spread: the peak a
            # run can reach (the skip only lowers it), and the shapes the logged token rate gives.
            "train.skip_zero_advantage=false",
        ]
        measured[allocator], _ = peak_rss(
            [sys.executable, "-m", "posttrain", "grpo", *overrides], tmp / f"{out.name}.log"
        )
        records_by[allocator] = [r for r in read_jsonl(out / "metrics.jsonl") if "num_samples" in r]
    cfg = GRPOConfig()
    group = cfg.rollout.samples_per_prompt
    # The engine's KV pool with data.eval_size=0: max_num_seqs = the rollout batch, each sequence
    # max_prompt_tokens + max_tokens long, in whole 16-token blocks (posttrain.trainers.rl.run.engine_config).
    seqs = cfg.rollout.prompts_per_step * group
    kv_tokens = seqs * math.ceil((cfg.rollout.max_prompt_tokens + cfg.rollout.max_tokens) / 16) * 16
    best: dict[str, Any] = {}
    # The runs sample with the same seed, but their shapes are read from each run's own log.
    records = [r for allocator in args.allocators for r in records_by[allocator]]
    overhead = overheads[args.allocators[-1]]
    for record in records:
        samples = int(record["num_samples"])
        completion = round(record["response_len/mean"])
        trained = round(record["tokens/train_per_s"] * record["time/update_s"])  # real tokens through the model
        rows = math.ceil(samples / group)
        prompt = round(trained / rows - group * (completion - 1))
        setup = TrainingSetup(
            trainer="grpo",
            batch=samples,
            group_size=group,
            seq_len=prompt + completion,
            prompt_len=prompt,
            kv_tokens=kv_tokens,
            overhead_bytes=overhead,
        )
        est = estimate_memory(arch, setup)
        if est.total_bytes > best.get("total_bytes", -1):
            seconds = estimate_time(arch, setup, est.weights_bytes, 0.06, 20.0)
            best = {
                **est.as_dict(),
                "setup": setup,
                "shape": {
                    "samples": samples,
                    "completion_len": completion,
                    "prompt_len": prompt,
                    "trained_tokens": trained,
                    "kv_tokens": kv_tokens,
                },
                "time": {
                    "update_seconds_estimate": round(seconds.train_seconds, 2),
                    "update_seconds_measured": round(record["time/update_s"], 2),
                    "last_update_seconds": {a: round(records_by[a][-1]["time/update_s"], 2) for a in args.allocators},
                },
            }
    return _case("grpo", best, measured, overheads, args.tolerance, best.pop("time"))


# ----------------------------------------------------------------------------- report


def _case(
    name: str,
    est: dict[str, Any],
    measured: dict[str, int],
    overheads: dict[str, int],
    tolerance: float,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Estimate vs measured per allocator setting; the estimate's overhead term is each setting's own."""
    est = dict(est)
    est.pop("setup", None)
    base = est["total_bytes"] - est["runtime_overhead_bytes"]
    per_allocator = {}
    for allocator, rss in measured.items():
        estimate = base + overheads[allocator]
        ratio = estimate / rss
        per_allocator[allocator] = {
            "estimate_mib": round(estimate / 2**20),
            "measured_mib": round(rss / 2**20),
            "estimate_bytes": estimate,
            "measured_peak_rss_bytes": rss,
            "ratio": round(ratio, 3),
            "within_tolerance": abs(ratio - 1) <= tolerance,
        }
    keep = (
        "weights",
        "grads",
        "optimizer",
        "activations",
        "activations_checkpointed",
        "logits",
        "kv_cache",
        "reference",
        "runtime_overhead",
    )
    return {
        "case": name,
        **per_allocator,
        "components_mib": {k: round(est[f"{k}_bytes"] / 2**20, 1) for k in keep},
        "peak_rule": est["peak_rule"],
        "shape": est["shape"],
        **extra,
    }


def main() -> int:
    args = parse_args()
    from posttrain.estimate import Architecture

    arch = Architecture.from_model(args.model)
    with tempfile.TemporaryDirectory(prefix="posttrain-estimate-") as tmp_name:
        tmp = Path(tmp_name)
        probe = OVERHEAD_PROBE.format(model=args.model)
        overhead = peak_rss([sys.executable, "-c", probe], tmp / "overhead.log")[0]  # before any malloc policy
        overheads = {a: overhead for a in args.allocators}
        results = []
        for case in args.cases:
            if case == "grpo":
                results.append(run_grpo(args, arch, overheads, tmp))
            elif case == "dpo":
                results.append(run_dpo(args, arch, overheads, tmp))
            else:
                results.append(run_sft(args, arch, overheads, tmp, lora=case == "sft-lora"))
            print(json.dumps(results[-1]), file=sys.stderr)
    summary = {
        "benchmark": "estimate",
        "model": args.model,
        "tolerance": args.tolerance,
        "runtime_overhead_mib": {a: round(v / 2**20) for a, v in overheads.items()},
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "within_tolerance": {a: all(r[a]["within_tolerance"] for r in results) for a in args.allocators},
        "cases": results,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

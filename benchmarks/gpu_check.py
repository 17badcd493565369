"""The one-shot device check for a CUDA machine: every GPU branch of the engine and the trainers, in one run
under 8 minutes on one GPU, ending in one JSON report (the last line of stdout).

    bash benchmarks/gpu_check.sh             # on the GPU machine
    bash benchmarks/gpu_check.sh --dry-run   # anywhere, in seconds: the report's shape, every check skipped

Checks, in order (each a subprocess with its own time limit, all within the budget):
  parity             tests/engine/test_cuda_backends.py: dense logits against transformers in bf16, each paged
                     kernel (FlexAttention compiled, flash-attn if installed) against the reference on CUDA, the
                     engine's outputs per backend with CUDA graphs off and on
  rollout_graphs_off benchmarks/rollout.py on CUDA in bf16 against transformers `generate` (small sizes)
  rollout_graphs_on  the same with EngineConfig.cuda_graphs
  grpo_10_steps      `posttrain grpo` (the demo), 10 steps on CUDA with CUDA graphs, a checkpoint at step 5
  fsdp2_step         `posttrain sft` under torchrun --nproc_per_node 1: NCCL, FSDP2, bf16 mixed precision

Each check reports status (passed / failed / skipped), seconds, its command, the reason when not passed, and
its key figures. The report also names the device, torch, CUDA and the backends the engine picks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 470  # the whole run, under 8 minutes
TAIL_CHARS = 1500  # of a failed check's output, in the report


@dataclass
class Check:
    name: str
    command: Callable[[Path], list[str]]  # scratch directory -> argv
    timeout_s: int
    figures: Callable[[str, Path], dict]  # (stdout + stderr, scratch directory) -> key figures
    needs: tuple[str, ...] = ()  # repository files the command reads (checked in the dry run too)


def python() -> str:
    return sys.executable


def pytest_figures(output: str, scratch: Path) -> dict:
    """Counts from pytest's summary line, and the first failures' names."""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", output)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)
    return {**counts, "failed_tests": failed[:10]} if failed else counts


def rollout_figures(output: str, scratch: Path) -> dict:
    report = last_json(output)
    ours, hf = report.get("posttrain", {}), report.get("transformers", {})
    return {
        "posttrain_tokens_per_s": ours.get("tokens_per_s"),
        "transformers_tokens_per_s": hf.get("tokens_per_s"),
        "speedup": report.get("speedup"),
        "attention_backend": ours.get("attention_backend"),
        "kv_blocks": ours.get("kv_blocks"),
        "matmul_fraction": ours.get("matmul_fraction"),
        "steps": ours.get("steps"),
    }


def run_figures(keys: tuple[str, ...]) -> Callable[[str, Path], dict]:
    """The last value of each of `keys` in the run's metrics.jsonl, the first eval/accuracy, and the steps."""

    def figures(output: str, scratch: Path) -> dict:
        path = next(scratch.glob("run/metrics.jsonl"), None)
        if path is None:
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        found: dict = {"records": len(records)}
        for record in records:
            for key in keys:
                if key in record:
                    found.setdefault(f"first {key}", record[key])
                    found[key] = record[key]
        return found

    return figures


def last_json(output: str) -> dict:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return {}
    return {}


ROLLOUT = ["benchmarks/rollout.py", "--device", "cuda", "--prompts", "32", "--n", "8", "--max-tokens", "64"]
CHECKS = [
    Check(
        "parity",
        lambda s: [python(), "-m", "pytest", "tests/engine/test_cuda_backends.py", "-q", "-p", "no:cacheprovider"],
        170,
        pytest_figures,
        needs=("tests/engine/test_cuda_backends.py",),
    ),
    Check("rollout_graphs_off", lambda s: [python(), *ROLLOUT], 80, rollout_figures, needs=("benchmarks/rollout.py",)),
    Check(
        "rollout_graphs_on",
        lambda s: [python(), *ROLLOUT, "--cuda-graphs"],
        80,
        rollout_figures,
        needs=("benchmarks/rollout.py",),
    ),
    Check(
        "grpo_10_steps",
        lambda s: [
            python(), "-m", "posttrain", "grpo", "train.max_steps=10", "train.save_every=5", "data.eval_size=50",
            "model.device=cuda", "rollout.engine.cuda_graphs=true", f"out={s / 'run'}",
        ],
        100,
        run_figures(("reward/mean", "eval/accuracy", "time/step_s", "memory/cuda_max_allocated_gb")),
    ),
    Check(
        "fsdp2_step",
        lambda s: [
            python(), "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "posttrain", "sft",
            "examples/sft_gsm8k.yaml", "dist.strategy=fsdp2", "dist.mixed_precision=true", "train.max_steps=2",
            "data.eval_fraction=0", f"out={s / 'run'}",
        ],
        60,
        run_figures(("loss", "train/loss", "grad_norm", "time/step_s")),
        needs=("examples/sft_gsm8k.yaml",),
    ),
]  # fmt: skip


def run_check(check: Check, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{check.name}_") as tmp:
        scratch = Path(tmp)
        argv = check.command(scratch)
        entry: dict = {"command": " ".join(argv)}
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
            output, status = done.stdout + done.stderr, "passed" if done.returncode == 0 else "failed"
            reason = None if done.returncode == 0 else f"exit status {done.returncode}"
        except subprocess.TimeoutExpired as timeout:
            output = _text(timeout.stdout) + _text(timeout.stderr)
            status, reason = "failed", f"timed out after {timeout_s:.0f} s"
        entry["seconds"] = round(time.perf_counter() - start, 1)
        entry["status"] = status
        try:
            entry["figures"] = check.figures(output, scratch)
        except (OSError, ValueError) as error:  # a half-written metrics file, a non-JSON line
            entry["figures"] = {"unreadable": str(error)}
        if reason is not None:
            entry["reason"] = reason
            entry["output_tail"] = output[-TAIL_CHARS:]
        return entry


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def environment() -> dict:
    import torch

    from posttrain.engine.attention_backend import resolve_attention_backend

    cuda = torch.cuda.is_available()
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "python": sys.executable,
    }
    if cuda:
        device = torch.device("cuda")
        env["attention_backend_auto"] = resolve_attention_backend("auto", device, torch.bfloat16, 16)
        env["free_gb"] = round(torch.cuda.mem_get_info(device)[0] / 2**30, 1)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run nothing: print the report, every check skipped")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (by name)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    env = environment()
    checks: dict[str, dict] = {}
    for check in CHECKS:
        missing = [path for path in check.needs if not (ROOT / path).exists()]
        left = BUDGET_S - (time.perf_counter() - started)
        skip = None
        if missing:
            skip = f"missing {', '.join(missing)}"
        elif env["device"] is None:
            skip = "no CUDA"
        elif args.dry_run:
            skip = "dry run"
        elif args.only is not None and check.name not in args.only:
            skip = "not in --only"
        elif left < 10:
            skip = "time budget spent"
        if skip is not None:
            checks[check.name] = {
                "status": "skipped",
                "reason": skip,
                "seconds": 0.0,
                "command": " ".join(check.command(Path("SCRATCH"))),
                "figures": {},
            }
            continue
        print(f"gpu_check: {check.name} ...", file=sys.stderr, flush=True)
        checks[check.name] = run_check(check, min(check.timeout_s, left))
        print(f"gpu_check: {check.name} {checks[check.name]['status']}", file=sys.stderr, flush=True)
    ran = sum(c["status"] != "skipped" for c in checks.values())
    graphs_on = checks["rollout_graphs_on"]["figures"].get("posttrain_tokens_per_s")
    graphs_off = checks["rollout_graphs_off"]["figures"].get("posttrain_tokens_per_s")
    report = {
        "benchmark": "gpu_check",
        "dry_run": args.dry_run,
        "environment": env,
        "seconds": round(time.perf_counter() - started, 1),
        # None when nothing ran (a dry run, no CUDA); else whether every check that ran passed.
        "passed": None if ran == 0 else all(c["status"] != "failed" for c in checks.values()),
        "cuda_graphs_speedup": round(graphs_on / graphs_off, 2) if graphs_on and graphs_off else None,
        "checks": checks,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

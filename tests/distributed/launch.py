"""Run `posttrain <command>` under torchrun (gloo, CPU) from a test, and read what the run wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from posttrain.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc -m posttrain argv` with this worktree's package, one thread
    per process; fails the test with the ranks' output when it exits non-zero."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "posttrain", *argv]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir) if "loss" in record}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

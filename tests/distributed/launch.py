"""Run `posttrain <command>` under torchrun (gloo, CPU) from a test, and read what the run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from posttrain.metrics import read_metrics
from posttrain.peft.peft_format import ADAPTER_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def torchrun(
    nproc: int, argv: list[str], timeout: float = 300, module: str = "posttrain", should_fail: bool = False
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc -m module argv` with this worktree's package, one thread
    per process; fails the test with the ranks' output when it exits non-zero (zero, with `should_fail`) or runs
    past `timeout` seconds (ranks out of step wait in a collective forever: torchrun and its ranks are then killed
    together). module: posttrain's CLI, or a test's wrapper of it (tests/distributed/fp32_quant.py), which ends with
    `posttrain.cli.program(argv)` as the CLI does (a finished rank exits without the runtime's teardown, where gloo
    may abort it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *argv,
    ]
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun stops its ranks (each runs in a session of its own, out of reach of a group kill).
            proc.terminate()
            try:
                stderr = proc.communicate(timeout=60)[1]
            except subprocess.TimeoutExpired:
                proc.kill()
                stderr = "(torchrun did not stop on SIGTERM)"
            raise AssertionError(f"{' '.join(cmd)} still running after {timeout}s:\n{stderr[-6000:]}") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if should_fail:
        assert done.returncode != 0, f"{' '.join(cmd)} succeeded:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    else:
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir) if "loss" in record}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def one_process(argv: list[str]) -> None:
    """`posttrain argv` in this process (strategy none): the single process a torchrun run is compared with."""
    from posttrain.cli import main

    assert main(argv) == 0, argv


def final_files(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """final/'s tensor files by name, each loaded: the PEFT adapter and, where the trainer writes one, the
    score or value head beside it."""
    return {path.name: load_file(str(path)) for path in sorted((run_dir / "final").glob("*.safetensors"))}


def final_adapter_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "final" / ADAPTER_CONFIG).read_text())


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

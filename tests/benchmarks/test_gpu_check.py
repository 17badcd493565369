"""benchmarks/gpu_check.sh, the one-shot device check, kept from rotting where there is no GPU: its dry run
prints the whole report with every check skipped, and the trainer commands it would run parse as configs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import parse_cli_config
from posttrain.trainers.rl.config import GRPOConfig
from posttrain.trainers.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["parity", "rollout_graphs_off", "rollout_graphs_on", "grpo_10_steps", "fsdp2_step"]


def _gpu_check_module(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _dry_run(python: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": python},
    )


def test_dry_run_prints_every_check_skipped() -> None:
    done = _dry_run(sys.executable)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "gpu_check" and report["dry_run"] is True
    assert report["passed"] is None  # nothing ran
    assert list(report["checks"]) == CHECKS
    reason = "dry run" if torch.cuda.is_available() else "no CUDA"
    for name, check in report["checks"].items():
        assert check["status"] == "skipped", name
        assert check["reason"] == reason, (name, check["reason"])  # not "missing <file>": its inputs exist
        assert check["seconds"] == 0.0 and check["figures"] == {}
        assert check["command"]
    assert report["environment"]["torch"] == torch.__version__


def test_a_missing_python_is_named() -> None:
    done = _dry_run("/nonexistent/python")
    assert done.returncode == 2 and "no Python at /nonexistent/python" in done.stderr


@pytest.mark.parametrize(
    ("check", "command", "config"), [("grpo_10_steps", "grpo", GRPOConfig), ("fsdp2_step", "sft", SFTConfig)]
)
def test_trainer_commands_are_valid_configs(
    check: str, command: str, config: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overrides the check passes are keys and values the trainer accepts (a renamed key fails here)."""
    gpu_check = _gpu_check_module(monkeypatch)
    argv = next(c for c in gpu_check.CHECKS if c.name == check).command(tmp_path)
    monkeypatch.chdir(ROOT)  # the example configs are named relative to the repository
    cfg = parse_cli_config(config, argv[argv.index(command) + 1 :])
    assert cfg.train.max_steps in (2, 10)

"""Exact resume, end to end: `posttrain sft / dpo / grpo` killed with SIGKILL mid-run and continued with
`--resume auto` write the same losses and end with the same parameters, bit for bit, as a run that was
never stopped. And a kill in the middle of a checkpoint write leaves the previous checkpoint to resume.

Each run is a fresh process (tests/checkpoint/kill_wrapper.py) on one thread, so the runs compare bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.models.checkpoint_io import save_hf_dir
from tests.data.tiny import save_tiny_model_dir
from tests.trainers.pref_helpers import pair_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = Path(__file__).with_name("kill_wrapper.py")
STEPS = 6
KILL_AT_UPDATE = 4  # inside step 4: checkpoint 2 is the newest committed one, step 3 is already logged


def run_cli(mode: str, count: int, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(WRAPPER), mode, str(count), "--", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    final = run_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(final / name))


def check_kill_and_resume(tmp_path: Path, argv: list[str], keys: tuple[str, ...]) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = run_cli("none", 0, [*argv, f"out={whole}"])
    assert done.returncode == 0, done.stderr[-3000:]
    dead = run_cli("update", KILL_AT_UPDATE, [*argv, f"out={killed}"])
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-3000:]
    assert (killed / "checkpoints" / "step-2" / "COMMITTED").is_file()
    assert max(r["step"] for r in records(killed)) == KILL_AT_UPDATE - 1, "step 3 was logged before the kill"
    resumed = run_cli("none", 0, [*argv, f"out={killed}", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected = [r for r in records(whole) if r["step"] >= 1]
    got = [r for r in records(killed) if r["step"] >= 1]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "one record per step, none twice"
    for want, have in zip(expected, got):
        for key in keys:
            assert have[key] == want[key], (want["step"], key, have[key], want[key])  # bitwise: JSON floats round-trip
    want, have = final_tensors(whole), final_tensors(killed)
    assert want.keys() == have.keys()
    assert all(torch.equal(want[k], have[k]) for k in want), "final parameters differ"
    assert not list(killed.glob("config.before-resume*")), "an unchanged config is kept as it is"


def sft_data(tmp_path: Path) -> Path:
    rows = [{"prompt": f"What is {i} plus {i}?", "completion": f"It is {2 * i}."} for i in range(10)]
    return write_jsonl(tmp_path / "sft.jsonl", rows)


def common(model: Path, data: Path) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"data.path={data}",
        "train.progress=false",
        f"train.max_steps={STEPS}",
        "train.save_every=2",
        "train.batch_size=2",
        "optim.lr=1e-2",
    ]


def test_sft_with_lora_dropout_resumes_bitwise(tmp_path: Path) -> None:
    # LoRA dropout draws from torch's generator every step: only a restored RNG state gives the same masks.
    model = save_tiny_model_dir(tmp_path / "model")
    argv = ["sft", *common(model, sft_data(tmp_path)), "lora.r=4", "lora.dropout=0.2"]
    check_kill_and_resume(tmp_path, argv, ("loss", "grad_norm", "lr"))


def test_dpo_resumes_bitwise(tmp_path: Path) -> None:
    model = save_tiny_model_dir(tmp_path / "model")
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    argv = ["dpo", *common(model, data), "data.eval_fraction=0.25", "train.eval_every=3"]
    check_kill_and_resume(tmp_path, argv, ("loss", "grad_norm", "lr", "rewards/margins"))


def test_grpo_resumes_bitwise(tmp_path: Path) -> None:
    from tests.trainers.rl_helpers import reward_file, tiny_model, tokenizer

    tok = tokenizer()
    model = save_hf_dir(tiny_model(tok), tmp_path / "model", tokenizer=tok)
    argv = [
        "grpo",
        f"model.name_or_path={model}",
        f"reward.functions=[{reward_file(tmp_path)}:char_mix]",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_tokens=6",
        "data.eval_size=0",
        "log.progress=false",
        f"train.max_steps={STEPS}",
        "train.save_every=2",
        "train.max_minutes=null",
        "optim.lr=1e-2",
    ]
    check_kill_and_resume(
        tmp_path, argv, ("loss/policy", "reward/mean", "grad_norm", "entropy", "policy_version", "optimizer_steps")
    )


def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path: Path) -> None:
    model = save_tiny_model_dir(tmp_path / "model")
    argv = ["sft", *common(model, sft_data(tmp_path))]
    whole, torn = tmp_path / "whole", tmp_path / "torn"
    assert run_cli("none", 0, [*argv, f"out={whole}"]).returncode == 0
    dead = run_cli("commit", 4, [*argv, f"out={torn}"])
    assert dead.returncode == -signal.SIGKILL
    assert (torn / "checkpoints" / "step-4").is_dir() and not (torn / "checkpoints" / "step-4" / "COMMITTED").exists()
    resumed = run_cli("none", 0, [*argv, f"out={torn}", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-4: no COMMITTED marker" in resumed.stderr and "resuming from" in resumed.stderr
    assert f"checkpoints{os.sep}step-2" in resumed.stderr.split("resuming from", 1)[1].splitlines()[0]
    assert [r["loss"] for r in records(torn)] == [r["loss"] for r in records(whole)]
    want, have = final_tensors(whole), final_tensors(torn)
    assert all(torch.equal(want[k], have[k]) for k in want)
    assert (torn / "checkpoints" / "step-4" / "COMMITTED").is_file(), "the resumed run rewrote step 4 whole"


@pytest.mark.parametrize("resume", ["auto", "PATH"])
def test_resume_finds_nothing_or_refuses_a_torn_path(tmp_path: Path, resume: str) -> None:
    model = save_tiny_model_dir(tmp_path / "model")
    argv = ["sft", *common(model, sft_data(tmp_path)), "train.max_steps=2"]
    if resume == "auto":  # nothing there yet: a fresh start, so a job script can always pass --resume auto
        done = run_cli("none", 0, [*argv, f"out={tmp_path / 'fresh'}", "--resume", "auto"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in records(tmp_path / "fresh")] == [1, 2]
        return
    torn = tmp_path / "run" / "checkpoints" / "step-2"
    torn.mkdir(parents=True)
    failed = run_cli("none", 0, [*argv, f"--resume={torn}"])
    assert failed.returncode == 2 and "no COMMITTED marker" in failed.stderr

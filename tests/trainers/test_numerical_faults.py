"""Numerical faults: a NaN step leaves weights and optimizer state untouched and the run goes on;
`train.max_bad_steps` of them in a row end the run with one line naming the step and the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import posttrain.trainers.sft as sft
from posttrain.cli import main as cli_main
from posttrain.config import load_config
from posttrain.trainers.faults import BadStepGuard, NumericalFault
from posttrain.trainers.optim import build_optimizer, optimizer_step
from posttrain.trainers.sft import SFTConfig, start_sft
from tests.data.tiny import save_tiny_model_dir, tiny_model
from tests.trainers.pref_helpers import write_jsonl


def test_a_nan_loss_skips_the_update_entirely():
    model = tiny_model()
    optimizer = build_optimizer(model, 1e-2)
    ids = torch.arange(8).reshape(1, 8)
    model(ids).square().mean().backward()
    optimizer_step(optimizer, None, 1.0)  # AdamW now holds moments
    before = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
    loss = model(ids).square().mean() * float("nan")
    loss.backward()
    grad_norm, applied = optimizer_step(optimizer, None, 1.0, loss=float(loss.detach()))
    assert not applied
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(v, optimizer.state[next(model.parameters())][k]) for k, v in moments.items())
    assert all(p.grad is None for p in model.parameters()), "the poisoned gradients are cleared"


def test_guard_counts_and_aborts_after_k_in_a_row():
    guard = BadStepGuard(2)
    guard.record(1, False, float("nan"), 1.0)
    guard.record(2, True, 0.5, 1.0)
    guard.record(3, False, 0.5, float("inf"))
    with pytest.raises(NumericalFault, match=r"step 4: 2 updates in a row .*loss=nan, grad_norm=nan.*max_bad_steps=2"):
        guard.record(4, False, float("nan"), float("nan"))
    assert guard.state_dict() == {"in_a_row": 2, "total": 3}


@pytest.fixture
def sft_overrides(tmp_path: Path) -> list[str]:
    model = save_tiny_model_dir(tmp_path / "model")
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"Say {i}.", "completion": f"{i}."} for i in range(8)])
    return [
        f"model.name_or_path={model}",
        f"data.path={data}",
        "train.progress=false",
        "train.batch_size=2",
        "optim.lr=1e-2",
        "train.max_steps=5",
        "train.max_bad_steps=2",
    ]


def poison_steps(monkeypatch, steps: set[int]):
    """Make the loss NaN on the given 1-based optimizer steps (every micro-batch of the step)."""
    real, calls = sft.sft_loss_sum, {"step": 0}

    def loss_sum(model, batch):
        loss = real(model, batch)
        return loss * float("nan") if calls["step"] in steps else loss

    monkeypatch.setattr(sft, "sft_loss_sum", loss_sum)

    def advance(step_fn):
        def run(index: int):
            calls["step"] = index + 1
            return step_fn(index)

        return run

    return advance


def test_one_nan_step_changes_nothing_and_the_run_goes_on(tmp_path: Path, monkeypatch, sft_overrides):
    advance = poison_steps(monkeypatch, {3})
    session = start_sft(load_config(SFTConfig, None, [*sft_overrides, f"out={tmp_path / 'run'}"]))
    step = advance(session.step)
    for index in range(2):
        step(index)
    weights = [p.detach().clone() for p in session.model.parameters()]
    state = {k: v.clone() for k, v in session.optimizer.state[next(session.model.parameters())].items()}
    out = step(2)
    assert out["skipped_updates"] == 1 and out["loss"] != out["loss"]
    assert all(torch.equal(a, b) for a, b in zip(weights, session.model.parameters()))
    assert all(torch.equal(v, session.optimizer.state[next(session.model.parameters())][k]) for k, v in state.items())
    out = step(3)
    assert out["skipped_updates"] == 1 and out["loss"] == out["loss"]
    assert not all(torch.equal(a, b) for a, b in zip(weights, session.model.parameters())), "the run goes on"


def test_k_nan_steps_in_a_row_abort_cleanly(tmp_path: Path, monkeypatch, sft_overrides, capsys):
    poison = poison_steps(monkeypatch, {2, 3})
    monkeypatch.setattr(sft, "start_sft", lambda cfg, _real=sft.start_sft: _wrap(_real(cfg), poison))
    assert cli_main(["sft", *sft_overrides, f"out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "error: step 3: 2 updates in a row skipped for non-finite values (last: loss=nan" in err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["skipped_updates"] == 1


def _wrap(session, advance):
    session.step = advance(session.step)
    return session

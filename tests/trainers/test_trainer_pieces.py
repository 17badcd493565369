"""The shared trainer pieces: optimizer groups, schedules, clipping, the step loop, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.checkpoint.save import list_checkpoints, save_checkpoint
from posttrain.metrics import MetricsLogger, read_metrics
from posttrain.trainers.loop import batch_stream, run_steps, steps_for_epochs
from posttrain.trainers.optim import build_optimizer, optimizer_step, param_groups
from posttrain.trainers.schedule import build_scheduler, lr_multiplier, warmup_steps_for
from tests.data.tiny import tiny_model, tiny_tokenizer


def test_param_groups_decay_matrices_only_and_count_tied_weights_once():
    model = tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert (
        len(ids) == len(set(ids))
        and sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_parameters()
    )
    model.embed_tokens.weight.requires_grad_(False)  # frozen parameters are left out
    assert all(p is not model.embed_tokens.weight for g in param_groups(model, 0.1) for p in g["params"])


def test_optimizer_is_fused_on_cpu_and_steps():
    model = tiny_model()
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.01)
    assert optimizer.defaults["fused"] is True
    before = model.layers[0].mlp.up_proj.weight.clone()
    model(torch.randint(0, 300, (2, 8))).sum().backward()
    grad_norm, applied = optimizer_step(optimizer, None, max_grad_norm=1.0)
    assert applied and grad_norm > 0 and all(p.grad is None for p in model.parameters())
    assert not torch.equal(before, model.layers[0].mlp.up_proj.weight)


def test_clipping_and_non_finite_gradients():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    param.grad = torch.tensor([3.0, 4.0, 0.0])
    grad_norm, applied = optimizer_step(optimizer, None, max_grad_norm=1.0)
    assert grad_norm == pytest.approx(5.0) and applied
    torch.testing.assert_close(param.detach(), torch.tensor([-0.6, -0.8, 0.0]))
    param.grad = torch.tensor([float("nan"), 1.0, 0.0])
    grad_norm, applied = optimizer_step(optimizer, None, max_grad_norm=None)
    assert math.isnan(grad_norm) and not applied
    torch.testing.assert_close(param.detach(), torch.tensor([-0.6, -0.8, 0.0]))  # update skipped


@pytest.mark.parametrize("schedule, at_end", [("constant", 1.0), ("linear", 0.1), ("cosine", 0.0245)])
def test_schedules(schedule, at_end):
    values = [lr_multiplier(s, warmup_steps=2, total_steps=12, schedule=schedule) for s in range(12)]
    assert values[:3] == [0.5, 1.0, 1.0]  # warmup reaches the peak at step warmup_steps - 1
    assert values[-1] == pytest.approx(at_end, abs=1e-3)
    assert all(a >= b for a, b in zip(values[1:], values[2:]))
    floor = lr_multiplier(11, warmup_steps=0, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    assert 0.1 < floor < 0.13
    assert warmup_steps_for(100, 0, 0.05) == 5 and warmup_steps_for(100, 3, 0.0) == 3


def test_scheduler_drives_the_optimizer_lr():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = build_scheduler(optimizer, total_steps=4, warmup_steps=2, schedule="linear")
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05])
    with pytest.raises(ValueError, match="unknown schedule"):
        build_scheduler(optimizer, total_steps=4, schedule="step")


def test_batch_stream_reshuffles_epochs_and_is_seeded():
    items = list(range(10))
    first = [b for b, _ in zip(batch_stream(items, 4, seed=1), range(5))]
    assert first == [b for b, _ in zip(batch_stream(items, 4, seed=1), range(5))]
    flat = [x for batch in first for x in batch]
    assert sorted(flat[:10]) == items and sorted(flat[10:20]) == items and flat[:10] != flat[10:20]
    assert steps_for_epochs(10, 2.0, 4) == 5


def test_run_steps_logs_records_saves_and_evaluates(tmp_path):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    saved = []
    with MetricsLogger(tmp_path) as metrics:
        last = run_steps(
            lambda step: {"loss": 1.0 / (step + 1), "tokens": 100},
            max_steps=5,
            optimizer=optimizer,
            metrics=metrics,
            log_every=2,
            save_every=2,
            save_fn=saved.append,
            eval_every=4,
            eval_fn=lambda: {"eval_loss": 0.25},
            progress=False,
        )
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [2, 4, 5]
    assert records[0]["loss"] == 0.5 and records[0]["lr"] == 0.5 and records[0]["tokens/train_per_s"] > 0
    assert "eval_loss" in records[1] and "eval_loss" in records[2] and last["eval_loss"] == 0.25
    assert saved == [2, 4]


def test_run_steps_progress_bar_shows_the_trainers_headline_metrics(capsys):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    run_steps(
        lambda step: {"loss": 0.5, "tokens": 10, "rewards/accuracies": 0.75},
        max_steps=2,
        optimizer=optimizer,
        progress=True,
        postfix={"acc": "rewards/accuracies", "margin": "absent"},
    )
    bar = capsys.readouterr().err
    assert "acc=0.75" in bar and "loss=0.5000" in bar and "margin" not in bar


def test_checkpoints_are_hf_dirs_and_pruned(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    for step in (1, 2, 3):
        save_checkpoint(model, tok, tmp_path, step, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    assert (tmp_path / "checkpoints" / "step-3" / "tokenizer.json").is_file()


def test_accumulating_named_terms_divides_each_by_its_own_denominator():
    """Two loss terms with different normalisers (RL: the policy term by its aggregation's count, the value
    loss by tokens), over three micro-batches: the gradient and the loss of the whole batch at once."""
    from posttrain.trainers.accumulate import accumulate_gradients

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 4, generator=gen, dtype=torch.float64), torch.randn(9, generator=gen, dtype=torch.float64)
    weight = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def terms(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = x[rows] @ weight
        return {"policy": (pred * y[rows]).sum(), "value": (pred - y[rows]).square().sum()}

    whole = terms(torch.arange(9))  # normalisers: "policy" as if over 4 sequences, "value" over the 9 rows
    want_loss = whole["policy"] / 4 + whole["value"] / 9
    (want_grad,) = torch.autograd.grad(want_loss, weight)
    micro = [torch.arange(0, 2), torch.arange(2, 5), torch.arange(5, 9)]
    out = accumulate_gradients(micro, lambda rows: (terms(rows), {"rows": len(rows)}), {"policy": 4.0, "value": 9.0})
    # float64 sums of 9 terms of size ~1 in another order: a few ulps apart
    torch.testing.assert_close(weight.grad, want_grad, rtol=1e-12, atol=1e-12)
    assert out["loss"] == pytest.approx(float(want_loss.detach()), rel=1e-12) and out["rows"] == 9
    with pytest.raises(ValueError, match="denominator 'value' must be positive"):
        accumulate_gradients(micro, lambda rows: (terms(rows), {}), {"policy": 4.0, "value": 0.0})


def test_run_steps_stops_when_asked_and_keeps_what_a_step_measured_itself(tmp_path):
    """RL's time budget is a stop hook asked before every step; a step that times its own work (RL) keeps its
    time/step_s and lr, and a step without loss or tokens (RL's skipped step) is logged as it is."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    asked = []

    def step(index: int) -> dict[str, float]:
        if index == 1:
            return {"skipped": 1}
        return {"loss": 1.0, "tokens": 10, "time/step_s": 123.0, "lr": 0.25}

    def stop(steps_done: int) -> bool:
        asked.append(steps_done)
        return steps_done == 3

    with MetricsLogger(tmp_path) as metrics:
        last = run_steps(
            step, max_steps=10, optimizer=optimizer, metrics=metrics, progress=False, should_stop=stop, start_step=1
        )
    records = read_metrics(tmp_path)
    assert asked == [1, 2, 3] and [r["step"] for r in records] == [2, 3] and last["loss"] == 1.0
    assert records[0]["skipped"] == 1 and "tokens/train_per_s" not in records[0] and records[0]["lr"] == 0.5
    assert records[1]["time/step_s"] == 123.0 and records[1]["lr"] == 0.25 and records[1]["tokens/train_per_s"] > 0

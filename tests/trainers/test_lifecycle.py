"""The pieces every trainer runs around its step (trainers.lifecycle) and the section helpers beside them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from posttrain.checkpoint.resume import RunStart
from posttrain.checkpoint.save import checkpoint_dir
from posttrain.data.validate import DataError
from posttrain.metrics import read_metrics
from posttrain.trainers.lifecycle import open_checkpointer, pad_token_id, train_and_evaluate, write_data_report
from posttrain.trainers.loop import batch_stream
from posttrain.trainers.optim import optimizer_for
from posttrain.trainers.schedule import build_scheduler, scheduler_for
from posttrain.trainers.sections import LogSection, ModelSection, OptimSection, TrainSection
from tests.data.tiny import tiny_model, tiny_tokenizer


@dataclass
class RunConfig:
    """The keys the pieces read from a trainer's config."""

    model: ModelSection = field(default_factory=lambda: ModelSection(name_or_path="tiny"))
    train: TrainSection = field(default_factory=TrainSection)
    log: LogSection = field(default_factory=LogSection)
    resume: str | None = None


def test_pad_token_id_is_the_pad_token_else_eos_else_an_error_naming_the_model():
    assert pad_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=7), "m") == 3
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=7), "m") == 7
    assert pad_token_id(SimpleNamespace(pad_token_id=0, eos_token_id=7), "m") == 0  # id 0 is an id
    with pytest.raises(DataError, match=r"^models/x: the tokenizer has neither a pad nor an EOS token to pad with$"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None), "models/x")


def test_total_steps_is_max_steps_or_the_epochs_over_the_items():
    train = TrainSection(batch_size=4, grad_accum=3, epochs=1.5)
    assert train.items_per_step == 12
    assert train.total_steps(100) == 13  # ceil(1.5 * 100 / 12)
    assert TrainSection(batch_size=4, max_steps=5).total_steps(100) == 5
    assert TrainSection(batch_size=64).total_steps(3) == 1  # never zero steps


def test_optimizer_and_scheduler_follow_the_optim_section():
    model = tiny_model()
    optim = OptimSection(lr=1e-3, weight_decay=0.1, betas=[0.8, 0.95], eps=1e-6, warmup_ratio=0.25, min_lr_ratio=0.1)
    optimizer = optimizer_for(model, optim)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (1e-3, 0.1, (0.8, 0.95), 1e-6)
    scheduler = scheduler_for(optimizer, optim, total_steps=8)
    reference = build_scheduler(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3),
        total_steps=8,
        warmup_steps=2,  # ceil(0.25 * 8)
        schedule="cosine",
        min_lr_ratio=0.1,
    )
    for _ in range(8):
        assert optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        reference.optimizer.step()
        reference.step()


def test_write_data_report(tmp_path):
    write_data_report(tmp_path, {"path": "data/é.jsonl", "rows_kept": 2})
    text = (tmp_path / "data_report.json").read_text(encoding="utf-8")
    assert json.loads(text) == {"path": "data/é.jsonl", "rows_kept": 2} and "é" in text and text.endswith("}\n")


def test_open_checkpointer_starts_fresh_or_resumes_the_checkpoint(tmp_path):
    cfg = RunConfig(train=TrainSection(keep_checkpoints=2))
    model, tokenizer = tiny_model(), tiny_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = batch_stream(list(range(10)), 3, seed=0)
    checkpointer, start_step = open_checkpointer(
        "sft", cfg, RunStart(tmp_path, None), model, tokenizer, optimizer, None, None, state={"data": stream}
    )
    assert start_step == 0
    assert (checkpointer.base_model, checkpointer.keep_last, checkpointer.run_dir) == ("tiny", 2, tmp_path)
    next(stream), next(stream)
    checkpointer.save(2)

    resumed = batch_stream(list(range(10)), 3, seed=0)
    start = RunStart(tmp_path, checkpoint_dir(tmp_path, 2))
    _, start_step = open_checkpointer(
        "sft", cfg, start, model, tokenizer, optimizer, None, None, state={"data": resumed}
    )
    assert start_step == 2 and resumed.position == 2


@pytest.mark.parametrize("start_step", [0, 2])
def test_train_and_evaluate_reports_the_held_out_figures_before_and_after(tmp_path, start_step):
    cfg = RunConfig(train=TrainSection(eval_every=0, progress=False))
    evaluations = iter([{"eval_loss": 3.0}, {"eval_loss": 1.0}])
    saved: list[int] = []
    checkpointer = SimpleNamespace(
        run_dir=tmp_path, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), save=saved.append
    )
    reports: list[tuple[str, float]] = []
    last = train_and_evaluate(
        cfg,
        lambda step: {"loss": float(step)},
        checkpointer,  # type: ignore[arg-type]  # what it reads of a Checkpointer
        start_step,
        4,
        lambda: next(evaluations),
        desc="test",
        report=lambda when, record: reports.append((when, record["eval_loss"])),
    )
    assert last["loss"] == 3.0 and last["eval_loss"] == (1.0 if start_step == 0 else 3.0)
    records = read_metrics(tmp_path)
    if start_step == 0:  # a fresh run is evaluated before its first step, as step 0
        assert reports == [("before", 3.0), ("after", 1.0)]
        assert [r["step"] for r in records] == [0, 1, 2, 3, 4] and records[0]["eval_loss"] == 3.0
    else:  # a resumed run has had its "before"
        assert reports == [("after", 3.0)]
        assert [r["step"] for r in records] == [3, 4]
    assert saved == []


def test_train_and_evaluate_without_report_evaluates_only_at_the_end(tmp_path):
    cfg = RunConfig(train=TrainSection(progress=False))
    calls: list[int] = []

    def evaluate() -> dict[str, float]:
        calls.append(1)
        return {"eval_loss": 1.0}

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    checkpointer = SimpleNamespace(run_dir=tmp_path, optimizer=optimizer, save=None)
    last = train_and_evaluate(cfg, lambda step: {"loss": 1.0}, checkpointer, 0, 2, evaluate, desc="t")  # type: ignore[arg-type]
    assert calls == [1] and last["eval_loss"] == 1.0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]

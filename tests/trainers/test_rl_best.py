"""`eval.save_best`: the model of the best held-out evaluation is kept beside the last one, ties keep the
earlier, NaN never wins, and a resumed run only replaces it with a better one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.models.hub import load_model
from posttrain.trainers.rl import train_grpo
from posttrain.trainers.rl.best import BestModel, best_record
from posttrain.trainers.rl.config import GRPOConfig
from tests.trainers.rl_helpers import rl_overrides, tiny_model, tokenizer


def _recording_best(run_dir: Path) -> tuple[BestModel, list[int]]:
    saved: list[int] = []
    best = BestModel(run_dir, lambda out: saved.append(len(saved)))
    return best, saved


def test_only_a_better_accuracy_saves(tmp_path: Path) -> None:
    best, saved = _recording_best(tmp_path)
    offers = [(0, 0.2), (1, 0.5), (2, 0.5), (3, math.nan), (4, 0.4), (5, 0.6)]
    assert [best.offer(step, acc) for step, acc in offers] == [True, True, False, False, False, True]
    assert len(saved) == 3 and best_record(tmp_path) == {"step": 5, "accuracy": 0.6}


def test_a_resumed_run_keeps_the_best_it_had(tmp_path: Path) -> None:
    first, _ = _recording_best(tmp_path)
    first.offer(10, 0.5)
    again, saved = _recording_best(tmp_path)  # a new process on the same run directory
    assert (again.step, again.accuracy) == (10, 0.5)
    assert not again.offer(20, 0.5) and again.offer(30, 0.7) and saved == [0]
    assert best_record(tmp_path) == {"step": 30, "accuracy": 0.7}


def test_the_run_writes_the_model_of_its_best_evaluation(tmp_path: Path, monkeypatch) -> None:
    """Scripted held-out accuracies 0.2, 0.5, 0.3 (steps 0, 1, 2): <run>/best holds the weights after step 1,
    and differs from <run>/final (step 2)."""
    import posttrain.trainers.rl.train as rl

    accuracies = iter([0.2, 0.5, 0.3])
    real_evaluate, real_step = rl.evaluate, rl.rl_step

    def scripted(*args, **kwargs):
        metrics, samples = real_evaluate(*args, **kwargs)
        return {**metrics, "eval/accuracy": next(accuracies)}, samples

    tok = tokenizer()
    model = tiny_model(tok)
    after: dict[int, dict[str, torch.Tensor]] = {}

    def step(run, index):
        out = real_step(run, index)
        after[index] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out

    monkeypatch.setattr(rl, "evaluate", scripted)
    monkeypatch.setattr(rl, "rl_step", step)
    extra = ("train.max_steps=2", "data.eval_size=2", "eval.every=1", "eval.save_best=true", "optim.lr=1e-2")
    run_dir = train_grpo(
        load_config(GRPOConfig, None, rl_overrides(tmp_path, "best", *extra)), model=model, tokenizer=tok
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["step"] == 1 and summary["best"]["accuracy"] == pytest.approx(0.5)
    assert best_record(run_dir) == {"step": 1, "accuracy": 0.5}
    best, _ = load_model(str(run_dir / "best"), dtype="float32")
    final, _ = load_model(str(run_dir / "final"), dtype="float32")
    for name, value in best.state_dict().items():
        torch.testing.assert_close(value, after[1][name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(final.state_dict()[n], v) for n, v in best.state_dict().items())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("eval/best_saved")] == [0, 1]

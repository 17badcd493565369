"""Off-policy distillation data-parallel on CPU (gloo): 2 torchrun processes against 1 on the same rows; the
teacher is a whole frozen copy on every rank, the student is spread by the strategy."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.metrics import read_metrics
from posttrain.trainers.distill import DistillConfig, train_distill
from tests.data.tiny import save_tiny_model_dir
from tests.dist.launch import final_weights, max_difference, torchrun
from tests.trainers.pref_helpers import config, setup_dir

TOLERANCE = 1e-5
STEP = ["train.batch_size=4", "train.grad_accum=2", "train.max_steps=1", "optim.lr=1e-2", "loss=jsd",
        "data.eval_fraction=0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("distill-dist")
    student, data = setup_dir(root, seed=0)
    return student, save_tiny_model_dir(root / "teacher", seed=1), data


@pytest.fixture(scope="module")
def one_process(tiny, tmp_path_factory) -> Path:
    student, teacher, data = tiny
    return train_distill(config(DistillConfig, student, data, tmp_path_factory.mktemp("one") / "run",
                                f"teacher.name_or_path={teacher}", *STEP))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_distill_as_one(strategy, tiny, one_process, tmp_path):
    student, teacher, data = tiny
    out = tmp_path / "run"
    torchrun(2, ["distill", f"model.name_or_path={student}", f"teacher.name_or_path={teacher}", f"data.path={data}",
                 f"out={out}", "train.progress=false", f"dist.strategy={strategy}", *STEP])
    [got], [want] = read_metrics(out), read_metrics(one_process)
    assert got["loss_tokens"] == want["loss_tokens"] and got["tokens"] == want["tokens"]
    for key in ("loss", "grad_norm"):
        assert abs(got[key] - want[key]) <= TOLERANCE * max(1.0, abs(want[key])), key
    assert max_difference(final_weights(out), final_weights(one_process)) <= TOLERANCE

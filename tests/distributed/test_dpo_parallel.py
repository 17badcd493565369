"""DPO data-parallel on CPU (gloo): 2 torchrun processes against 1 on the same global batch of pairs."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors
from posttrain.trainers.dpo import DPOConfig, train_dpo
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.trainers.pref_helpers import config, setup_dir

TOLERANCE = 1e-5
# A global batch of 4 pairs x 2 accumulation steps; each rank takes 2 pairs of every micro-batch.
STEP = ["train.batch_size=4", "train.grad_accum=2", "train.max_steps=1", "optim.lr=1e-2", "optim.warmup_ratio=0",
        "data.eval_fraction=0", "beta=0.5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return setup_dir(tmp_path_factory.mktemp("dpo-dist"))


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory) -> Path:
    model, pairs = data
    return train_dpo(config(DPOConfig, model, pairs, tmp_path_factory.mktemp("one") / "run", *STEP))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_dpo_step_of_one(strategy, data, one_process, tmp_path):
    model, pairs = data
    out = tmp_path / "run"
    torchrun(2, ["dpo", f"model.name_or_path={model}", f"data.path={pairs}", f"out={out}", "train.progress=false",
                 f"dist.strategy={strategy}", *STEP])
    [got] = read_metrics(out)
    [want] = read_metrics(one_process)
    assert got["pairs"] == want["pairs"] == 8 and got["tokens"] == want["tokens"]
    for key in ("loss", "grad_norm", "rewards/margins", "nll/chosen"):
        assert abs(got[key] - want[key]) <= TOLERANCE * max(1.0, abs(want[key])), key
    reference = final_weights(one_process)
    assert max_difference(read_safetensors(model), reference) > 1e-3  # the step moved the weights
    assert max_difference(final_weights(out), reference) <= TOLERANCE

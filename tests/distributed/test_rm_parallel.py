"""Reward-model training data-parallel (DDP, gloo): 2 torchrun processes against 1 on the same pairs; the
score head trains beside the trunk, and its gradient must be reduced with the trunk's."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.metrics import read_metrics
from posttrain.trainers.reward_model import RMConfig, train_reward_model
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.trainers.pref_helpers import config, setup_dir

TOLERANCE = 1e-5
STEP = ["train.batch_size=4", "train.grad_accum=2", "train.max_steps=1", "optim.lr=1e-2", "data.eval_fraction=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return setup_dir(tmp_path_factory.mktemp("rm-dist"))


def test_two_ddp_processes_train_the_reward_model_of_one(data, tmp_path):
    model, pairs = data
    one = train_reward_model(config(RMConfig, model, pairs, tmp_path / "one", *STEP))
    two = tmp_path / "two"
    torchrun(2, ["rm", f"model.name_or_path={model}", f"data.path={pairs}", f"out={two}", "train.progress=false",
                 "dist.strategy=ddp", *STEP])
    [got], [want] = read_metrics(two), read_metrics(one)
    assert got["pairs"] == want["pairs"] == 8
    for key in ("loss", "grad_norm", "accuracy", "margin"):
        assert abs(got[key] - want[key]) <= TOLERANCE * max(1.0, abs(want[key])), key
    assert max_difference(final_weights(two), final_weights(one)) <= TOLERANCE
    heads = [load_file(str(run / "final" / "score.safetensors")) for run in (one, two)]
    assert max_difference(*heads) <= TOLERANCE

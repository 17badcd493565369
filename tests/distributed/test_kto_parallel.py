"""Paired KTO data-parallel on CPU (gloo): 2 torchrun processes against 1 on the same global batch of pairs.

KTO's KL reference point z0 is a mean over the micro-batch's mismatched rows; each rank gathers the other
ranks' KL logps so it clamps the same z0 as one process. z0 is 0 while the policy equals the reference, so the
run takes 3 steps: the later ones have a moved policy and a non-zero z0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.metrics import read_metrics
from posttrain.trainers.dpo import DPOConfig, train_dpo
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.trainers.pref_helpers import config, setup_dir

TOLERANCE = 1e-5
STEP = ["loss=kto", "train.batch_size=4", "train.grad_accum=2", "train.max_steps=2", "optim.lr=1e-2",
        "optim.warmup_ratio=0", "data.eval_fraction=0", "beta=0.5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return setup_dir(tmp_path_factory.mktemp("kto-dist"))


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory) -> Path:
    model, pairs = data
    return train_dpo(config(DPOConfig, model, pairs, tmp_path_factory.mktemp("one") / "run", *STEP))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_kto_steps_of_one(strategy, data, one_process, tmp_path):
    model, pairs = data
    out = tmp_path / "run"
    torchrun(2, ["dpo", f"model.name_or_path={model}", f"data.path={pairs}", f"out={out}", "train.progress=false",
                 f"dist.strategy={strategy}", *STEP])
    got, want = read_metrics(out), read_metrics(one_process)
    assert len(got) == len(want) == 2
    assert max(record["kl"] for record in want) > 1e-4  # z0 is in play, so a per-rank z0 would show
    for g, w in zip(got, want):
        assert g["pairs"] == w["pairs"] == 8
        for key in ("loss", "kl", "grad_norm", "rewards/chosen"):
            assert abs(g[key] - w[key]) <= TOLERANCE * max(1.0, abs(w[key])), (g["step"], key, g[key], w[key])
    assert max_difference(final_weights(out), final_weights(one_process)) <= TOLERANCE

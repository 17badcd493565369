"""Reward-model training data-parallel (DDP and FSDP2, gloo): 2 torchrun processes against 1 on the same pairs;
the score head trains beside the trunk, and its gradient must be reduced with the trunk's (DDP: in its buckets;
FSDP2: the head is sharded by the root group, beside the embeddings). FSDP2 also resumes its sharded
checkpoint, head and its optimizer state included, on 1 process."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.metrics import read_metrics
from posttrain.trainers.reward_model import RMConfig, train_reward_model
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, torchrun
from tests.numeric import EQUIVALENCE_EPS
from tests.trainers.pref_helpers import config, setup_dir

LR = 1e-2
OPTIM = [f"optim.lr={LR}", f"optim.eps={EQUIVALENCE_EPS}"]  # eps: AdamW's gain on the rounding (tests/numeric.py)
STEP = ["train.batch_size=4", "train.grad_accum=2", "train.max_steps=1", *OPTIM, "data.eval_fraction=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return setup_dir(tmp_path_factory.mktemp("rm-dist"))


def _two_processes(data: tuple[Path, Path], out: Path, strategy: str, *args: str) -> Path:
    model, pairs = data
    torchrun(
        2,
        [
            "rm",
            f"model.name_or_path={model}",
            f"data.path={pairs}",
            f"out={out}",
            "train.progress=false",
            f"dist.strategy={strategy}",
            *args,
        ],
    )
    return out


def _heads(*runs: Path) -> list[dict]:
    return [load_file(str(run / "final" / "score.safetensors")) for run in runs]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_train_the_reward_model_of_one(strategy, data, tmp_path):
    model, pairs = data
    one = train_reward_model(config(RMConfig, model, pairs, tmp_path / "one", *STEP))
    two = _two_processes(data, tmp_path / "two", strategy, *STEP)
    got, want = read_metrics(two), read_metrics(one)
    assert got[0]["pairs"] == want[0]["pairs"] == 8
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm", "accuracy", "margin"])
    assert_same_weights(final_weights(two), final_weights(one), lr=LR, eps=EQUIVALENCE_EPS, updates=1)
    assert_same_weights(*_heads(two, one), lr=LR, eps=EQUIVALENCE_EPS, updates=1)


def test_two_fsdp2_processes_resume_the_reward_model_on_one(data, tmp_path):
    """3 steps on 2 FSDP2 ranks with a checkpoint at step 2 (trunk, head and both's AdamW moments in shards/);
    1 plain process resumed from it takes step 3 as the 2 ranks did."""
    model, pairs = data
    steps = [
        "train.batch_size=4",
        "train.grad_accum=1",
        "train.max_steps=3",
        "train.save_every=2",
        *OPTIM,
        "data.eval_fraction=0",
    ]
    two = _two_processes(data, tmp_path / "two", "fsdp2", *steps)
    checkpoint = two / "checkpoints" / "step-2"
    assert (checkpoint / "shards" / ".metadata").is_file() and not (checkpoint / "modules.safetensors").exists()
    one = train_reward_model(config(RMConfig, model, pairs, tmp_path / "one", *steps, f"resume={checkpoint}"))
    got, want = read_metrics(one), read_metrics(two)[-1:]
    assert got[0]["step"] == want[0]["step"] == 3
    # From the same weights and moments: step 3 as one fresh step of the 2 ranks.
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])
    assert_same_weights(final_weights(one), final_weights(two), lr=LR, eps=EQUIVALENCE_EPS, updates=1)
    assert_same_weights(*_heads(one, two), lr=LR, eps=EQUIVALENCE_EPS, updates=1)

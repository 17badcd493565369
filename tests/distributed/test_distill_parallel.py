"""Distillation data-parallel on CPU (gloo): 2 torchrun processes against 1 on the same rows; the teacher is a
whole frozen copy on every rank, the student is spread by the strategy.

On-policy, each rank samples its share of every micro-batch's prompts with its own engine over the live student;
`seed_prompts=true` seeds each prompt's request from (train.seed, step, its place among the step's prompts),
so a prompt gets the same completion on whichever rank it lands. Two steps: the second samples from the
student the first update wrote (gathered whole under FSDP2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors
from posttrain.trainers.distill import DistillConfig, train_distill
from tests.data.tiny import save_tiny_model_dir
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.numeric import EQUIVALENCE_EPS
from tests.trainers.pref_helpers import config, setup_dir

LR = 1e-2
# optim.eps: AdamW's gain on the gradients' rounding (tests/numeric.py).
OPTIM = [f"optim.lr={LR}", f"optim.eps={EQUIVALENCE_EPS}"]
OFF_POLICY_STEPS = [
    "train.batch_size=4",
    "train.grad_accum=2",
    "train.max_steps=1",
    *OPTIM,
    "loss=jsd",
    "data.eval_fraction=0",
]
ON_POLICY_STEPS = [
    "mode=on_policy",
    "seed_prompts=true",
    "max_new_tokens=6",
    "train.batch_size=4",
    "train.grad_accum=2",
    "train.max_steps=2",
    *OPTIM,
    "loss=jsd",
    "data.eval_fraction=0",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("distill-dist")
    student, data = setup_dir(root, seed=0)
    return student, save_tiny_model_dir(root / "teacher", seed=1), data


def run_one_process(tiny, out: Path, steps: list[str]) -> Path:
    student, teacher, data = tiny
    return train_distill(config(DistillConfig, student, data, out, f"teacher.name_or_path={teacher}", *steps))


def run_two_processes(tiny, out: Path, strategy: str, steps: list[str]) -> Path:
    student, teacher, data = tiny
    torchrun(
        2,
        [
            "distill",
            f"model.name_or_path={student}",
            f"teacher.name_or_path={teacher}",
            f"data.path={data}",
            f"out={out}",
            "train.progress=false",
            f"dist.strategy={strategy}",
            *steps,
        ],
    )
    return out


@pytest.fixture(scope="module")
def one_process(tiny, tmp_path_factory) -> Path:
    return run_one_process(tiny, tmp_path_factory.mktemp("one") / "run", OFF_POLICY_STEPS)


@pytest.fixture(scope="module")
def one_process_on_policy(tiny, tmp_path_factory) -> Path:
    return run_one_process(tiny, tmp_path_factory.mktemp("one-on-policy") / "run", ON_POLICY_STEPS)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_distill_as_one(strategy, tiny, one_process, tmp_path):
    out = run_two_processes(tiny, tmp_path / "run", strategy, OFF_POLICY_STEPS)
    got, want = read_metrics(out), read_metrics(one_process)
    assert got[0]["loss_tokens"] == want[0]["loss_tokens"] and got[0]["tokens"] == want[0]["tokens"]
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])
    assert_same_weights(final_weights(out), final_weights(one_process), lr=LR, eps=EQUIVALENCE_EPS, updates=1)


@pytest.mark.parametrize("strategy, rollout_weights", [("ddp", "whole"), ("fsdp2", "whole"), ("fsdp2", "per_layer")])
def test_two_processes_sample_and_distill_as_one(strategy, rollout_weights, tiny, one_process_on_policy, tmp_path):
    """per_layer: the student's layers gathered one at a time in each engine forward, the ranks in lockstep."""
    student = tiny[0]
    steps = [*ON_POLICY_STEPS, f"dist.rollout_weights={rollout_weights}"]
    out = run_two_processes(tiny, tmp_path / "run", strategy, steps)
    got, want = read_metrics(out), read_metrics(one_process_on_policy)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for mine, theirs in zip(got, want):  # the same samples (completion-token count) ...
        assert mine["loss_tokens"] == theirs["loss_tokens"] > 0, mine["step"]
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])  # ... and the same updates
    reference = final_weights(one_process_on_policy)
    assert max_difference(read_safetensors(student), reference) > 1e-3  # the steps moved the weights
    assert_same_weights(final_weights(out), reference, lr=LR, eps=EQUIVALENCE_EPS, updates=2)

"""GRPO data-parallel on CPU (gloo): 2 torchrun processes against 1 over the same prompts.

Exactness comes from `rollout.seed_prompts`: each prompt's request is seeded from (train.seed, step, its place
among the step's prompts), so the rank that gets it samples the very completions the single process does;
the rest (group advantages, the globally-normalised token-mean loss, the gradient reduction) is then exact.
Two steps: the second samples from the weights the first update wrote (gathered whole under FSDP2). The FSDP2
run also checkpoints step 1 (DCP shards), which one plain process resumes into the same step 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors
from posttrain.trainers.rl import train_grpo
from posttrain.trainers.rl.config import GRPOConfig
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.distributed.rl_setup import LR, rl_overrides
from tests.numeric import EQUIVALENCE_EPS

# The same completions (same rewards, lengths) and the same updates. Means over the samples are exact (equal
# shares); spreads such as reward/std are the ranks' averaged, not compared.
SAMPLED = ("num_samples", "reward/mean", "response_len/mean")


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    """4 prompts x 4 samples a step, micro-batches of one group (each rank accumulates 2 of them), a KL term
    against a frozen reference copy (the rest: tests/distributed/rl_setup.py)."""
    return rl_overrides(
        tmp_path_factory.mktemp("grpo-dist"), "rollout.samples_per_prompt=4", "train.micro_batch_size=4", "kl.beta=0.1"
    )


@pytest.fixture(scope="module")
def one_process(overrides, tmp_path_factory) -> Path:
    return train_grpo(load_config(GRPOConfig, None, [*overrides, f"out={tmp_path_factory.mktemp('one') / 'run'}"]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_grpo_steps_of_one(strategy, overrides, one_process, tmp_path):
    out = tmp_path / "run"
    save = ["train.save_every=1"] if strategy == "fsdp2" else []  # a sharded checkpoint at step 1, resumed below
    torchrun(2, ["grpo", *overrides, f"out={out}", f"dist.strategy={strategy}", *save])
    got, want = read_metrics(out), read_metrics(one_process)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    assert all(r["num_samples"] == 16 for r in want)
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"], sampled=SAMPLED)
    reference = final_weights(one_process)
    model_dir = Path(next(o for o in overrides if o.startswith("model.")).split("=", 1)[1])
    assert max_difference(read_safetensors(model_dir), reference) > 1e-3  # the steps moved the weights
    assert_same_weights(final_weights(out), reference, lr=LR, eps=EQUIVALENCE_EPS, updates=2)
    if strategy == "fsdp2":
        # The 2-rank sharded checkpoint, resumed by one plain process: step 2 samples and updates as before.
        resumed = train_grpo(
            load_config(
                GRPOConfig,
                None,
                [*overrides, f"out={tmp_path / 'resumed'}", f"resume={out / 'checkpoints' / 'step-1'}"],
            )
        )
        # From the same weights and moments: step 2 as one fresh step of the 2 ranks.
        assert_same_steps(
            read_metrics(resumed), got[1:], lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"], sampled=SAMPLED
        )
        assert_same_weights(final_weights(resumed), final_weights(out), lr=LR, eps=EQUIVALENCE_EPS, updates=1)

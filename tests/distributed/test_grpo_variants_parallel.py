"""GRPO-family variants with batch-wide statistics, data-parallel on CPU (gloo): 2 torchrun processes against 1
over the same prompts (seeded per prompt with `rollout.seed_prompts`, as in test_grpo_parallel.py).

reinforce_pp whitens its returns over the whole batch: the ranks all-reduce the mean and variance of every
rank's tokens, so the advantages, the loss and the update are those of the single process."""

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
from tests.trainers.rl_helpers import reward_file

SAMPLED = ("num_samples", "reward/mean", "response_len/mean")  # of the same completions at every step


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """4 prompts x 4 samples a step, micro-batches of one group (the rest: tests/distributed/rl_setup.py)."""
    return rl_overrides(
        tmp_path_factory.mktemp("grpo-variants"), "rollout.samples_per_prompt=4", "train.micro_batch_size=4"
    )


@pytest.fixture(scope="module")
def reinforce_pp_one(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rpp-one") / "run"
    return train_grpo(load_config(GRPOConfig, None, [*base, "algorithm=reinforce_pp", f"out={out}"]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_whiten_reinforce_pp_as_one(strategy, base, reinforce_pp_one, tmp_path):
    out = tmp_path / "run"
    torchrun(2, ["grpo", *base, "algorithm=reinforce_pp", f"out={out}", f"dist.strategy={strategy}"])
    got, want = read_metrics(out), read_metrics(reinforce_pp_one)
    assert len(want) == 2 and want[0]["num_samples"] == 16
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"], sampled=SAMPLED)
    reference = final_weights(reinforce_pp_one)
    model_dir = Path(next(o for o in base if o.startswith("model.")).split("=", 1)[1])
    assert max_difference(read_safetensors(model_dir), reference) > 1e-3  # the steps moved the weights
    assert_same_weights(final_weights(out), reference, lr=LR, eps=EQUIVALENCE_EPS, updates=2)


@pytest.fixture(scope="module")
def dapo_one(base, tmp_path_factory) -> tuple[list[str], Path]:
    """DAPO with dynamic sampling and a reward that is 0 for every sample of an odd-answer prompt: those
    groups have no variance, are dropped, and the batch is refilled from further prompts."""
    root = tmp_path_factory.mktemp("dapo-one")
    extra = [
        "algorithm=dapo",
        f"reward.functions=[{reward_file(root)}:parity_gated]",
        "dapo.max_refill_rounds=3",
        "dapo.overlong_cache_len=2",
    ]
    args = [*(o for o in base if not o.startswith("reward.functions=")), *extra]
    return args, train_grpo(load_config(GRPOConfig, None, [*args, f"out={root / 'run'}"]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_drop_and_refill_the_groups_of_one(strategy, dapo_one, tmp_path):
    args, one = dapo_one
    out = tmp_path / "run"
    torchrun(2, ["grpo", *args, f"out={out}", f"dist.strategy={strategy}"])
    got, want = read_metrics(out), read_metrics(one)
    assert sum(r["dapo/dropped_groups"] for r in want) > 0 and sum(r["dapo/refill_rounds"] for r in want) >= 1
    # The same refill decisions (taken on every rank's groups), the same kept groups, the same update.
    decisions = ("dapo/dropped_groups", "dapo/refill_rounds", "dapo/extra_prompts", "dapo/kept_groups")
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"], sampled=[*decisions, *SAMPLED])
    assert_same_weights(final_weights(out), final_weights(one), lr=LR, eps=EQUIVALENCE_EPS, updates=2)

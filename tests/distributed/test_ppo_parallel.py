"""PPO data-parallel (DDP and FSDP2, gloo): 2 torchrun processes against 1 over the same seeded prompts. The
value head trains beside the trunk (its gradient reduced with the trunk's; under FSDP2 it is sharded by the root
group, gathered whole for the rollout and the final save) and the advantages are whitened over every rank's
samples, so the two runs make the same updates."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.trainers.rl import train_ppo
from posttrain.trainers.rl.config import PPOConfig
from posttrain.trainers.rl.ppo import VALUE_HEAD_FILE
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, torchrun
from tests.distributed.rl_setup import LR, rl_overrides
from tests.numeric import EQUIVALENCE_EPS
from tests.trainers.rl_helpers import reward_file

UPDATES_PER_STEP = 2  # minibatches of a rollout
SAMPLED = ("optimizer_steps", "reward/mean")  # of the same completions at every step


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    """4 prompts x 2 samples a step in 2 minibatches (so the no-grad pass for pi_old and V runs, and two
    optimizer steps per rollout; the rest: tests/distributed/rl_setup.py). The value head at the policy's rate,
    not its default 100x: at lr 1 AdamW's gain of 2 lr / eps on the head's rounding (tests/numeric.py) moves the
    next rollout's values, and with them the advantages of the whole update."""
    return rl_overrides(
        tmp_path_factory.mktemp("ppo-dist"),
        "rollout.samples_per_prompt=2",
        "train.epochs=1",
        "train.minibatch_size=4",
        f"ppo.value_lr={LR}",
    )


@pytest.fixture(scope="module")
def ppo_one(overrides, tmp_path_factory):
    return train_ppo(load_config(PPOConfig, None, [*overrides, f"out={tmp_path_factory.mktemp('ppo-one') / 'run'}"]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_ppo_steps_of_one(strategy, overrides, ppo_one, tmp_path):
    one = ppo_one
    two = tmp_path / "two"
    torchrun(2, ["ppo", *overrides, f"out={two}", f"dist.strategy={strategy}"])
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, sampled=SAMPLED, updates_per_step=UPDATES_PER_STEP)
    updates = 2 * UPDATES_PER_STEP
    assert_same_weights(final_weights(two), final_weights(one), lr=LR, eps=EQUIVALENCE_EPS, updates=updates)
    heads = [load_file(str(run / "final" / VALUE_HEAD_FILE)) for run in (two, one)]
    assert_same_weights(*heads, lr=LR, eps=EQUIVALENCE_EPS, updates=updates)


def test_two_ddp_processes_drop_and_refill_ppo_groups_as_one(overrides, tmp_path):
    """DAPO's dynamic sampling inside PPO: the ranks take the refill decisions on every rank's groups (the code
    GRPO uses), so the kept groups, the GAE advantages and the updates are the single process's.

    One step: its rollout (3 groups dropped, a refill round) comes before any update, so its samples are the
    single process's exactly. A second step would sample from weights that differ by the all-reduce's rounding
    (within adam_drift), and one token drawn at a CDF step's edge changes a sample: on an AVX2 EPYC the second
    step's reward/mean was 0.11104 against 0.11035."""
    args = [
        *overrides,
        f"reward.functions=[{reward_file(tmp_path)}:parity_gated]",
        "dapo.dynamic_sampling=true",
        "dapo.max_refill_rounds=2",
        "train.max_steps=1",
    ]
    one = train_ppo(load_config(PPOConfig, None, [*args, f"out={tmp_path / 'one'}"]))
    two = tmp_path / "two"
    torchrun(2, ["ppo", *args, f"out={two}", "dist.strategy=ddp"])
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in want] == [1] and want[0]["dapo/dropped_groups"] > 0
    for mine, theirs in zip(got, want):
        for key in ("dapo/dropped_groups", "dapo/refill_rounds", "dapo/kept_groups", "num_samples"):
            assert mine[key] == theirs[key], (mine["step"], key)
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, sampled=SAMPLED, updates_per_step=UPDATES_PER_STEP)
    assert_same_weights(final_weights(two), final_weights(one), lr=LR, eps=EQUIVALENCE_EPS, updates=UPDATES_PER_STEP)

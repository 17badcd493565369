"""Every rank's RNG state in the checkpoint: a 2-process GRPO run whose rollouts draw from each rank's own
generator (`rollout.seed_prompts=false`: rank r's stream is seeded `train.seed + r`) resumed on 2 processes
samples and trains exactly as the run that never stopped. Resumed on 1 process it goes on with a warning."""

from __future__ import annotations

import logging

import pytest

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.trainers.rl import train_grpo
from posttrain.trainers.rl.config import GRPOConfig
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.distributed.rl_setup import rl_overrides

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    """4 prompts x 2 unseeded samples a step, a checkpoint after each of the 2 steps (rl_setup.py for the rest)."""
    return rl_overrides(
        tmp_path_factory.mktemp("rng-dist"),
        "rollout.samples_per_prompt=2",
        "rollout.seed_prompts=false",
        "train.save_every=1",
    )


def test_two_processes_resume_their_own_random_streams(overrides, tmp_path, caplog):
    whole = tmp_path / "whole"
    torchrun(2, ["grpo", *overrides, f"out={whole}", "dist.strategy=ddp"])
    checkpoint = whole / "checkpoints" / "step-1"
    resumed = tmp_path / "resumed"
    torchrun(2, ["grpo", *overrides, f"out={resumed}", "dist.strategy=ddp", f"resume={checkpoint}"])
    [got], want = read_metrics(resumed), read_metrics(whole)[1]
    assert got["step"] == want["step"] == 2
    # Rank 1's completions come from its own restored stream (from rank 0's they would differ: other rewards,
    # lengths, loss).
    for key in ("reward/mean", "reward/std", "response_len/mean", "loss", "grad_norm"):
        assert abs(got[key] - want[key]) <= TOLERANCE * max(1.0, abs(want[key])), key
    assert max_difference(final_weights(resumed), final_weights(whole)) <= TOLERANCE

    # Another world size: rank 0 takes rank 0's streams, and the run says that its draws are not the 2 ranks'.
    with caplog.at_level(logging.WARNING, logger="posttrain.trainers"):
        one = train_grpo(load_config(GRPOConfig, None, [*overrides, f"out={tmp_path / 'one'}", f"resume={checkpoint}"]))
    assert [r["step"] for r in read_metrics(one)] == [2]
    assert "RNG states of 2 rank(s), this run has 1" in caplog.text

"""Rollout processes (dist.rollout_ranks=1, torchrun with 2 processes): rank 0 trains, rank 1 only generates on its
own copy of the weights, which rank 0 broadcasts after every step.

With rollout.max_staleness=0 the run is the one-process sync run (grpo and ppo): the same samples (every prompt seeded from its
place), the same losses and the same final weights (<= 1e-6; the trainer computes exactly what one process
does, on the broadcast-exact copy's samples). A rollout process that dies or hangs stops the trainer with one
line naming the rank, the checkpoints written before stay whole, and one resumes into the step the trainer took
next (the checkpoint keeps the prompt state the rollout rank sent)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.trainers.rl import train_grpo, train_ppo
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from posttrain.trainers.rl.ppo import VALUE_HEAD_FILE
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.distributed.rl_setup import LR, rl_overrides

SAMPLED = ("num_samples", "reward/mean", "response_len/mean")


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    """3 steps of 4 prompts x 4 samples (rollout.seed_prompts: the sync run samples what the rollout rank does)."""
    return rl_overrides(
        tmp_path_factory.mktemp("procs"),
        "rollout.samples_per_prompt=4",
        "train.micro_batch_size=4",
        "train.max_steps=3",
    )


# PPO: 2 samples per prompt in 2 minibatches (two optimizer steps, two versions, per step; the no-grad pass for
# pi_old and V runs), the value head at the policy's rate.
PPO = ["rollout.samples_per_prompt=2", "train.epochs=1", "train.minibatch_size=4", f"ppo.value_lr={LR}"]


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_a_rollout_process_at_staleness_0_gives_the_sync_run(command, overrides, tmp_path):
    argv = [*overrides, *(PPO if command == "ppo" else [])]
    train, config = (train_grpo, GRPOConfig) if command == "grpo" else (train_ppo, PPOConfig)
    sync = train(load_config(config, None, [*argv, f"out={tmp_path / 'sync'}"]))
    out = tmp_path / "procs"
    async_k0 = ["rollout.mode=async", "rollout.max_staleness=0", "dist.rollout_ranks=1"]
    torchrun(2, [command, *argv, f"out={out}", *async_k0])
    got, want = read_metrics(out), read_metrics(sync)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for mine, theirs in zip(got, want):
        for key in ("loss", "grad_norm", *SAMPLED):
            assert abs(mine[key] - theirs[key]) <= 1e-6, (mine["step"], key, mine[key], theirs[key])
        # drawn at the trainer's version, the whole model sent after every update
        assert mine["async/staleness_0"] == mine["num_samples"] and mine["async/stale_dropped"] == 0
        assert mine["async/weight_sync_mb"] > 0 and mine["async/weight_sync_s"] >= 0
    assert max_difference(final_weights(out), final_weights(sync)) <= 1e-6
    if command == "ppo":
        heads = [load_file(str(run / "final" / VALUE_HEAD_FILE)) for run in (out, sync)]
        assert max_difference(*heads) <= 1e-6


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_failed_rollout_process_stops_the_trainer_with_its_rank_and_whole_checkpoints(fault, overrides, tmp_path):
    out = tmp_path / "run"
    # The rollout rank fails as it starts step 3: the trainer has finished step 1 (checkpointed) and step 2.
    argv = [fault, "3", "grpo", *overrides, f"out={out}", "dist.rollout_ranks=1", "train.save_every=1"]
    done = torchrun(2, [*argv, "dist.rollout_timeout_s=5"], module="tests.distributed.rollout_faults", should_fail=True)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-4000:]
    what = "exited" if fault == "die" else "timed out"
    assert errors[0].startswith("error: rollout rank 1") and what in errors[0], errors[0]
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert out / "checkpoints" / "step-1" in checkpoints
    for path in checkpoints:  # every checkpoint directory is a whole one (a save cut short stays a partial one)
        if path.name.startswith("step-"):
            assert (path / "COMMITTED").is_file() and (path / "model.safetensors").is_file(), path
    if fault == "hang":  # the trainer logged step 2 before it waited for step 3 (a dead rank may cut it short)
        # The checkpoint holds the prompt source as the rollout rank left it after step 1: one process resumed from
        # it takes the step 2 the trainer took (the same prompts, hence samples, rewards and loss).
        resume = [f"out={tmp_path / 'resumed'}", f"resume={out / 'checkpoints' / 'step-1'}", "train.max_steps=2"]
        resumed = read_metrics(train_grpo(load_config(GRPOConfig, None, [*overrides, *resume])))
        taken = [r for r in read_metrics(out) if r["step"] == 2]
        assert [r["step"] for r in resumed] == [2] and len(taken) == 1
        for key in ("loss", *SAMPLED):
            assert abs(resumed[0][key] - taken[0][key]) <= 1e-6, (key, resumed[0][key], taken[0][key])

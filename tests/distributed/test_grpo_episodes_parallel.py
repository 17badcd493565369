"""GRPO on multi-turn episodes (`env:`) data-parallel on CPU (gloo): 2 torchrun processes against 1 over the same
prompts.

As in test_grpo_parallel.py, `rollout.seed_prompts` seeds each prompt's episodes from its place among the step's
prompts (every turn's request from the episode's seed and the turn's number), so the rank that gets a prompt
plays the very episodes the single process plays: the same turns, observations and rewards. The update is then
the single process's over the same global batch. The episodes' metrics (`env/*`, per-episode means over equal
shares) averaged over the ranks are the whole batch's."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors, save_hf_dir
from posttrain.trainers.rl import train_grpo, train_ppo
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from tests.data.tiny import tiny_tokenizer
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.numeric import EQUIVALENCE_EPS, reorder_close
from tests.rollout.episode_helpers import turn_ending_model, write_questions

# The same episodes: their count, rewards and lengths; every env/* rate but the time shares, below.
SAMPLED = ("num_samples", "reward/mean", "response_len/mean")
TIMED = ("env/time_share", "env/idle_share")  # wall-clock shares: each rank's own
# Lower than rl_setup's 1e-2, under which the model unlearns ending its turns by step 2 (single-turn episodes).
LR = 3e-3


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    """4 prompts x 2 episodes of up to 3 turns a step, the scripted environment of the episode tests (it scores its
    episodes itself), a model that ends its turns after a few tokens, a KL term against a frozen reference."""
    root = tmp_path_factory.mktemp("grpo-episodes-dist")
    model = save_hf_dir(turn_ending_model(), root / "model", tokenizer=tiny_tokenizer())
    data = write_questions(root / "questions.jsonl", 16)
    return [
        f"model.name_or_path={model}",
        "data.task=null",
        f"data.path={data}",
        "data.eval_size=0",
        "env.name=tests.rollout.episode_helpers:ScriptedEnv",
        "env.parser=tests.rollout.episode_helpers:plain_parser",
        "env.max_turns=3",
        "env.max_episode_tokens=100",
        "env.workers=1",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        "rollout.max_tokens=10",
        "rollout.seed_prompts=true",
        "train.max_steps=2",
        "train.skip_zero_advantage=false",
        "kl.beta=0.1",
        f"optim.lr={LR}",
        f"optim.eps={EQUIVALENCE_EPS}",
        "log.progress=false",
    ]


def test_two_processes_take_the_episode_steps_of_one(overrides, tmp_path):
    one = train_grpo(load_config(GRPOConfig, None, [*overrides, f"out={tmp_path / 'one'}"]))
    out = tmp_path / "two"
    torchrun(2, ["grpo", *overrides, f"out={out}", "dist.strategy=ddp"])
    got, want = read_metrics(out), read_metrics(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    assert all(r["num_samples"] == 8 for r in want)
    assert all(r["env/turns"] > 1 and r["env/tokens_observation"] > 0 for r in want)  # multi-turn episodes
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm", "kl"], sampled=SAMPLED)
    # Every episode rate, those only some episodes meet (env/finish/<reason>, env/tool_calls/echo) included: the
    # ranks' means of equal shares, a rate a rank did not meet counted as its 0.
    met = set()
    for mine, theirs in zip(got, want):
        rates = {k for k in theirs if k.startswith("env/") and k not in TIMED and k != "env/error"}
        assert {k for k in mine if k.startswith("env/") and k not in TIMED and k != "env/error"} == rates
        for key in rates:
            assert reorder_close(mine[key], theirs[key]), (theirs["step"], key, mine[key], theirs[key])
        met |= rates
    assert {"env/finish/done", "env/finish/turn_length", "env/tool_calls/echo"} <= met
    reference = final_weights(one)
    model_dir = Path(next(o for o in overrides if o.startswith("model.")).split("=", 1)[1])
    assert max_difference(read_safetensors(model_dir), reference) > 1e-3  # the steps moved the weights
    assert_same_weights(final_weights(out), reference, lr=LR, eps=EQUIVALENCE_EPS, updates=2)


def test_two_processes_take_the_ppo_episode_step_of_one(overrides, tmp_path):
    """PPO on episodes with per-turn rewards (the scripted environment's 0.5 per step): GAE on each rank's
    episodes, the advantages whitened over every rank's model tokens, two minibatches. One step (its rollout comes
    before any update, so its episodes are the single process's exactly)."""
    args = [
        *[o for o in overrides if not o.startswith(("train.max_steps", "kl.beta"))],
        "train.max_steps=1",
        "train.epochs=1",
        "train.minibatch_size=4",
        f"ppo.value_lr={LR}",
        "env.turn_rewards=per_turn",
        "env.options.turn_reward=0.5",
    ]
    one = train_ppo(load_config(PPOConfig, None, [*args, f"out={tmp_path / 'one'}"]))
    two = tmp_path / "two"
    torchrun(2, ["ppo", *args, f"out={two}", "dist.strategy=ddp"])
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in want] == [1] and want[0]["env/turns"] > 1
    # (value/returns_mean is a mean over each rank's tokens, which the ranks hold in unequal numbers: not compared)
    sampled = ("optimizer_steps", "reward/mean", "env/turns", "env/tokens_observation")
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, sampled=sampled, updates_per_step=2)
    assert_same_weights(final_weights(two), final_weights(one), lr=LR, eps=EQUIVALENCE_EPS, updates=2)

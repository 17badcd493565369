"""PPO (and REINFORCE++) on multi-turn episodes: the outcome reward sits on the episode's last MODEL token, GAE
steps over the model's tokens only (value and advantage carried across the observations between turns, checked
against a hand-computed episode), `env.turn_rewards=per_turn` puts each environment step's reward on the last
model token of its turn, `posttrain ppo` runs steps on a scripted environment, and what has no meaning is refused
on load naming its key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.algos.advantages import outcome_token_rewards, reinforce_pp_advantages
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.rollout.episode_batch import episodes_to_batch
from posttrain.trainers.rl import rl_step, setup_run, train_ppo
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from posttrain.trainers.rl.ppo import ppo_advantages
from posttrain.trainers.rl.update import prepare_batch
from tests.data.tiny import tiny_tokenizer
from tests.numeric import serial_sum_rtol
from tests.rollout.episode_helpers import (
    ROWS,
    ScriptedEnv,
    make_llm,
    plain_parser,
    runner,
    turn_ending_model,
    write_questions,
)

# Two model turns (tokens 0-1 and 4-5) around a two-token observation (2-3), then padding (6).
EPISODE_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
# The value head's output; on the observation and padding positions nonsense that GAE must never read.
EPISODE_VALUES = torch.tensor([[0.1, 0.2, 9.0, -7.0, 0.3, 0.4, 5.0]])
GAMMA, LAM = 0.9, 0.8
# Each hand-computed entry is a chain of at most 4 GAE steps of ~5 fp32 roundings each.
GAE_RTOL = serial_sum_rtol(20)


def _gae(turn_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo_advantages(
        torch.tensor([1.0]),
        EPISODE_VALUES,
        EPISODE_MASK,
        gamma=GAMMA,
        lam=LAM,
        whiten=False,
        turn_rewards=turn_rewards,
    )


def test_gae_on_an_episode_steps_over_the_model_s_tokens_only() -> None:
    # By hand, outcome 1 on token 5 (the last model token, not the padding after it); steps 5, 4, 1, 0:
    #   A5 = 1 - 0.4                                  = 0.6
    #   A4 = (0.9 * 0.4 - 0.3) + 0.72 * A5            = 0.492
    #   A1 = (0.9 * 0.3 - 0.2) + 0.72 * A4            = 0.42424      (V of token 4 is token 1's next value)
    #   A0 = (0.9 * 0.2 - 0.1) + 0.72 * A1            = 0.3854528
    want = torch.tensor([[0.3854528, 0.42424, 0.0, 0.0, 0.492, 0.6, 0.0]])
    adv, returns = _gae()
    torch.testing.assert_close(adv, want, rtol=GAE_RTOL, atol=GAE_RTOL)
    torch.testing.assert_close(returns, (want + EPISODE_VALUES) * EPISODE_MASK, rtol=GAE_RTOL, atol=GAE_RTOL)
    # Were the observations time steps (discounted, their values read), turn 1 would see another advantage.
    as_steps = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    wrong, _ = ppo_advantages(
        torch.tensor([1.0]), EPISODE_VALUES, as_steps, gamma=GAMMA, lam=LAM, whiten=False
    )  # (1, 7)
    assert (wrong[0, :2] - want[0, :2]).abs().min() > 0.1


def test_per_turn_rewards_credit_the_turn_that_earned_them() -> None:
    # 0.5 earned by turn 1 (on token 1), 0.25 by the last turn (on token 5, with the outcome):
    #   A5 = 1.25 - 0.4 = 0.85; A4 = 0.06 + 0.72 * 0.85 = 0.672
    #   A1 = (0.5 + 0.27 - 0.2) + 0.72 * 0.672 = 1.05384; A0 = 0.08 + 0.72 * 1.05384 = 0.8387648
    placed = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 0.25, 0.0]])
    adv, _ = _gae(placed)
    want = torch.tensor([[0.8387648, 1.05384, 0.0, 0.0, 0.672, 0.85, 0.0]])
    torch.testing.assert_close(adv, want, rtol=GAE_RTOL, atol=GAE_RTOL)


def test_the_outcome_sits_on_the_last_model_token() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0], [0.0] * 6])
    kl = torch.full((3, 6), 0.1)
    rewards = outcome_token_rewards(torch.tensor([2.0, math.nan, 3.0]), mask, per_token_kl=kl, kl_coef=0.5)
    want = torch.tensor(
        [
            [0.0, -0.05, -0.05, 0.0, 1.95, 0.0],  # an opening token moved into the completion, two turns
            [-0.05, -0.05, -0.05, -0.05, 0.0, 0.0],  # unscorable: no outcome, the KL only
            [0.0] * 6,  # nothing of it trains
        ]
    )
    torch.testing.assert_close(rewards, want, rtol=0, atol=1e-7)


def test_reinforce_pp_carries_the_return_across_observations() -> None:
    """Masked positions are not steps: turn 1 gets the discounted outcome of the episode, not 0."""
    _, returns = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), EPISODE_MASK.repeat(2, 1), gamma=GAMMA)
    want = torch.tensor([GAMMA**3, GAMMA**2, 0.0, 0.0, GAMMA, 1.0, 0.0])  # 3 model steps from token 0 to token 5
    torch.testing.assert_close(returns[0], want, rtol=GAE_RTOL, atol=GAE_RTOL)


def test_per_turn_rewards_land_on_each_turn_s_last_model_token() -> None:
    play = runner(make_llm(), env=lambda: ScriptedEnv(turn_reward=0.5))
    episodes, _ = play.run(ROWS * 2, [1, 2, 3, 4])
    batch = episodes_to_batch(episodes, 2, play.chat, "zero", "per_turn")
    assert batch.turn_rewards is None  # not added to the outcome as well
    seen_turns = 0
    for episode, mask, placed in zip(episodes, batch.completion_mask, batch.token_rewards, strict=True):
        assert len(placed) == len(mask)
        ends = [t for t, m in enumerate(mask) if m and (t + 1 == len(mask) or not mask[t + 1])]  # each turn's last
        stepped = ends[: len(episode.turn_rewards)]  # a turn cut off by a limit never reached the environment
        assert [t for t, r in enumerate(placed) if r] == stepped
        assert all(placed[t] == 0.5 for t in stepped)
        seen_turns += len(stepped)
    assert seen_turns >= 4  # several turns in all: placement was exercised beyond the last one
    summed = episodes_to_batch(episodes, 2, play.chat, "zero", "sum")
    assert summed.token_rewards is None and summed.turn_rewards == [sum(e.turn_rewards) for e in episodes]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_questions(tmp_path / "questions.jsonl")


def _overrides(tmp_path: Path, data: Path, name: str, *extra: str) -> list[str]:
    return [
        f"out={tmp_path / name}",
        "data.task=null",
        f"data.path={data}",
        "data.eval_size=0",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_tokens=10",
        "train.minibatch_size=2",
        "log.progress=false",
        "train.max_minutes=null",
        "env.name=scripted",
        "env.max_turns=3",
        "env.max_episode_tokens=100",
        "optim.lr=1e-3",
        *extra,
    ]


@pytest.mark.parametrize("turn_rewards", ["ignore", "per_turn"])
def test_ppo_steps_on_episodes(tmp_path: Path, data: Path, monkeypatch, turn_rewards: str) -> None:
    cfg = load_config(PPOConfig, None, _overrides(tmp_path, data, turn_rewards, f"env.turn_rewards={turn_rewards}"))
    run = setup_run(
        cfg,
        "ppo",
        model=turn_ending_model(),
        tokenizer=tiny_tokenizer(),
        make_env=lambda: ScriptedEnv(turn_reward=0.5),
        parser=plain_parser,
    )
    seen = []
    original = prepare_batch

    def keep(run_, batch):
        step_batch = original(run_, batch)
        seen.append(step_batch)
        return step_batch

    monkeypatch.setattr("posttrain.trainers.rl.step.prepare_batch", keep)
    for step in (1, 2):
        metrics = rl_step(run, step)
        assert metrics["optimizer_steps"] == 4 * step  # 2 epochs x 2 minibatches of one group
        for key in ("loss/policy", "loss/value", "value/returns_mean", "grad_norm", "env/turns"):
            assert math.isfinite(metrics[key]), key
        assert metrics["env/tokens_observation"] > 0
    for step_batch in seen:
        if turn_rewards == "per_turn":  # on model tokens only, one 0.5 per stepped turn
            assert step_batch.turn_rewards is not None and step_batch.turn_rewards.sum() > 0
            assert torch.all(step_batch.turn_rewards[step_batch.mask == 0] == 0)
        else:
            assert step_batch.turn_rewards is None


def test_train_ppo_runs_episodes_from_python(tmp_path: Path, data: Path) -> None:
    cfg = load_config(PPOConfig, None, _overrides(tmp_path, data, "e2e", "train.max_steps=1"))
    run_dir = train_ppo(
        cfg, model=turn_ending_model(), tokenizer=tiny_tokenizer(), make_env=ScriptedEnv, parser=plain_parser
    )
    assert (run_dir / "final" / "value_head.safetensors").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1


@pytest.mark.parametrize(
    ("config", "overrides", "match"),
    [
        (GRPOConfig, ["env.turn_rewards=per_turn"], "env.turn_rewards=per_turn .* use env.turn_rewards=sum"),
        (GRPOConfig, ["algorithm=rloo", "env.turn_rewards=per_turn"], "'rloo' scores whole episodes"),
        (PPOConfig, ["env.turn_rewards=each"], "env.turn_rewards"),
    ],
)
def test_per_turn_rewards_are_refused_where_they_mean_nothing(
    tmp_path: Path, data: Path, config: type, overrides: list[str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(config, None, _overrides(tmp_path, data, "bad", "rollout.samples_per_prompt=2", *overrides))


@pytest.mark.parametrize(
    ("config", "overrides"),
    [(PPOConfig, ["env.turn_rewards=per_turn"]), (GRPOConfig, ["algorithm=reinforce_pp", "env.turn_rewards=per_turn"])],
)
def test_token_level_estimators_take_episodes(tmp_path: Path, data: Path, config: type, overrides: list[str]) -> None:
    cfg = load_config(config, None, _overrides(tmp_path, data, "ok", *overrides))
    assert cfg.env.turn_rewards == "per_turn"


def test_posttrain_ppo_cli_plays_guess_number_from_yaml(tmp_path: Path, model_dir: Path) -> None:
    """`posttrain ppo CONFIG.yaml` with an `env:` section: two steps of the built-in guess_number game on a tiny
    random model, finite losses logged."""
    from posttrain.cli import main as cli_main

    config = tmp_path / "ppo_guess.yaml"
    config.write_text(
        f"model: {{name_or_path: {model_dir}, chat_template: chatml_tools}}\n"
        "data: {task: guess_number, eval_size: 0}\n"
        "env: {name: guess_number, options: {max_turns: 3}, max_turns: 3, max_episode_tokens: 60, workers: 1}\n"
        "rollout: {prompts_per_step: 2, samples_per_prompt: 2, max_tokens: 8, max_prompt_tokens: 256}\n"
        f"train: {{max_steps: 2, max_minutes: null, minibatch_size: 2}}\nout: {tmp_path / 'run'}\n"
        "log: {progress: false}\n"
    )
    assert cli_main(["ppo", str(config)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss/value" in s]
    assert len(steps) == 2
    for metrics in steps:
        for key in ("loss/policy", "loss/value", "env/turns", "reward/mean"):
            assert math.isfinite(metrics[key]), key


def test_reinforce_pp_steps_on_episodes_with_per_turn_rewards(tmp_path: Path, data: Path) -> None:
    overrides = _overrides(tmp_path, data, "rpp", "algorithm=reinforce_pp", "env.turn_rewards=per_turn")
    run = setup_run(
        load_config(GRPOConfig, None, overrides),
        "grpo",
        model=turn_ending_model(),
        tokenizer=tiny_tokenizer(),
        make_env=lambda: ScriptedEnv(turn_reward=0.5),
        parser=plain_parser,
    )
    for step in (1, 2):
        metrics = rl_step(run, step)
        assert metrics["optimizer_steps"] == 2 * step  # 1 epoch x 2 minibatches of one group
        for key in ("loss/policy", "grad_norm", "env/turns"):
            assert math.isfinite(metrics[key]), key

"""A reward function that raises is logged once per run (docs/rewards.md), though the run scores
training batches and held-out evaluations with it: the run's reward specs carry that memory."""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.config import load_config
from posttrain.rollout.evaluate import evaluate
from posttrain.trainers.rl import rl_step, setup_run
from posttrain.trainers.rl.config import GRPOConfig
from tests.trainers.rl_helpers import REWARD_SOURCE, tiny_model, tokenizer

BROKEN_JUDGE = (
    REWARD_SOURCE
    + """

def judge(completions, **kwargs):
    raise ConnectionError("judge server down")
"""
)


def _warnings_about(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and f"reward {name!r} raised" in r.getMessage()]


def test_a_raising_reward_warns_once_across_training_and_evaluation(tmp_path: Path, caplog) -> None:
    rewards = tmp_path / "rewards_for_test.py"
    rewards.write_text(BROKEN_JUDGE)
    tok = tokenizer()
    overrides = [
        f"reward.functions=[{rewards}:char_mix,{rewards}:judge]",
        "reward.weights=[1.0,0.0]",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_tokens=4",
        "train.minibatch_size=4",
        "data.eval_size=2",
        "log.progress=false",
    ]
    cfg = load_config(GRPOConfig, None, [f"out={tmp_path / 'run'}", *overrides])
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    with caplog.at_level(logging.DEBUG, logger="posttrain.rewards.combine"):
        for step in (1, 2):
            metrics = rl_step(run, step)
            assert metrics["reward/error"] == f"{rewards}:judge: ConnectionError: judge server down"
        evaluate(run.llm, run.held_out, run.specs, 4, cfg.reward.correct_threshold)
    warned = _warnings_about(caplog, f"{rewards}:judge")
    assert len(warned) == 1 and warned[0].exc_info is not None, [r.getMessage() for r in warned]
    later = [r for r in caplog.records if r.levelno == logging.DEBUG and "raised again" in r.getMessage()]
    assert len(later) == 2  # the second training batch and the evaluation: kept, at debug level

    # another run builds its specs anew, and warns again
    caplog.clear()
    again = setup_run(
        load_config(GRPOConfig, None, [f"out={tmp_path / 'again'}", *overrides]),
        "grpo",
        model=tiny_model(tok),
        tokenizer=tok,
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.combine"):
        rl_step(again, 1)
    assert len(_warnings_about(caplog, f"{rewards}:judge")) == 1

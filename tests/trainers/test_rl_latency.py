"""Async training hides environment latency: with `env.tool_latency_s` the sync run's steps grow by the waits,
the async run's (k = 1) barely, since its rollout waits while the previous step's update computes; and where the
rollout is the longer side (a fast update), the episode fill hides the waits behind the next steps' episodes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import posttrain.trainers.rl.step as rl_step_module
from posttrain.config import load_config
from posttrain.trainers.rl import rl_step, setup_run
from posttrain.trainers.rl.config import GRPOConfig
from tests.data.tiny import tiny_tokenizer
from tests.rollout.episode_helpers import ScriptedEnv, plain_parser, turn_ending_model, write_questions

LATENCY_S = 0.15  # per answered turn; ScriptedEnv(turns=3) answers 2 turns an episode: 0.3 s of waits per step
UPDATE_S = 0.6  # the update's compute, stood in by a sleep: longer than a rollout with its waits
STEPS = 4  # the first is left out of the timing (the async rollout starts with it)


def _timed_steps(tmp_path: Path, name: str, mode: str, latency: float, *extra: str) -> float:
    cfg = load_config(
        GRPOConfig,
        None,
        [
            f"out={tmp_path / name}",
            "data.task=null",
            f"data.path={write_questions(tmp_path / 'questions.jsonl')}",
            "data.eval_size=0",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=3",
            "rollout.max_tokens=6",
            f"rollout.mode={mode}",
            "rollout.max_staleness=1",
            "log.progress=false",
            "train.max_minutes=null",
            "env.name=scripted",
            "env.max_turns=3",
            "env.max_episode_tokens=60",
            "env.workers=6",  # every episode waits at once, as on a remote service
            f"env.tool_latency_s={latency}",
            *extra,
        ],
    )
    run = setup_run(
        cfg, "grpo", model=turn_ending_model(), tokenizer=tiny_tokenizer(), make_env=ScriptedEnv, parser=plain_parser
    )
    try:
        rl_step(run, 1)
        started = time.perf_counter()
        waits = sum(rl_step(run, step).get("env/latency_waits", 0.0) for step in range(2, STEPS + 1))
        elapsed = time.perf_counter() - started
    finally:
        if run.async_rollout is not None:
            run.async_rollout.close()
    assert (waits > 0) == (latency > 0)  # the waits happened (and are counted) only where asked for
    return elapsed


@pytest.fixture
def slow_update(monkeypatch):
    update = rl_step_module.update_policy

    def slow(*args, **kwargs):
        time.sleep(UPDATE_S)
        return update(*args, **kwargs)

    monkeypatch.setattr(rl_step_module, "update_policy", slow)


def test_async_hides_most_of_the_tool_latency_that_sync_pays(tmp_path: Path, slow_update) -> None:
    expected = (STEPS - 1) * 2 * LATENCY_S  # the timed steps' waits, episodes waiting concurrently
    sync_added = _timed_steps(tmp_path, "sync-l", "sync", LATENCY_S) - _timed_steps(tmp_path, "sync-0", "sync", 0)
    async_added = _timed_steps(tmp_path, "async-l", "async", LATENCY_S) - _timed_steps(tmp_path, "async-0", "async", 0)
    # Bounds far from both outcomes: sync pays the whole wait (0.9 s), async hides it behind the 0.6 s updates.
    assert sync_added >= 0.5 * expected, (sync_added, expected)
    assert async_added <= 0.35 * expected, (async_added, expected)


def test_the_episode_fill_hides_waits_when_the_rollout_is_the_longer_side(tmp_path: Path) -> None:
    """A fast update: async alone cannot hide the rollout's waits (they are its critical path); with
    rollout.async_fill the next steps' episodes (k = 2: up to two steps ahead) decode and wait meanwhile."""
    k2, latency = ("rollout.max_staleness=2", "env.workers=18"), 0.3
    plain = _timed_steps(tmp_path, "fill-off", "async", latency, *k2, "rollout.async_fill=0")
    filled = _timed_steps(tmp_path, "fill-on", "async", latency, *k2, "rollout.async_fill=0.5")
    waits = (STEPS - 1) * 2 * latency  # what the timed steps wait without overlap: 1.8 s
    assert plain >= 0.8 * waits, (plain, waits)  # without the fill the waits stay on the path
    assert filled <= plain - 0.5 * waits, (filled, plain, waits)  # the fill hides a good part of them

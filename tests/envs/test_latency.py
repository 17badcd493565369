"""env.tool_latency_s: one sleep per answered turn, none on the final answer, counted; bad values named."""

from __future__ import annotations

import pytest

from posttrain.config import load_config
from posttrain.envs import EnvError, ParsedTurn
from posttrain.envs.latency import DelayedEnvironment, with_latency
from posttrain.errors import ConfigError
from posttrain.trainers.rl.config import GRPOConfig
from tests.rollout.episode_helpers import ScriptedEnv


def test_each_answered_turn_waits_once_and_the_final_answer_does_not():
    slept: list[float] = []
    env = DelayedEnvironment(ScriptedEnv(turns=3), 0.5, sleep=slept.append)  # a tick clock: record, do not sleep
    assert env.reset({"question": "q"}) == [{"role": "user", "content": "q"}]
    first = env.step(ParsedTurn(text="a", content="a"))
    assert slept == [0.5] and first.counts["latency_waits"] == 1.0 and first.counts["tool_calls"] == 1
    env.step(ParsedTurn(text="b", content="b"))
    final = env.step(ParsedTurn(text="ccc", content="ccc"))  # ends the episode, nothing to observe
    assert final.done and "latency_waits" not in final.counts and slept == [0.5, 0.5]
    assert env.episode_reward() == 1.0 and env.tools is env.inner.tools


def test_zero_latency_is_the_factory_itself_and_bad_values_are_named():
    assert with_latency(ScriptedEnv, 0) is ScriptedEnv
    assert isinstance(with_latency(ScriptedEnv, 0.25)(), DelayedEnvironment)
    for bad in (-1, "1", True, float("nan")):
        with pytest.raises(EnvError, match="tool_latency_s must be a number >= 0"):
            with_latency(ScriptedEnv, bad)


@pytest.mark.parametrize(
    ("override", "match"),
    [("env.tool_latency_s=-0.5", "tool_latency_s must be >= 0"), ("env.tool_latency_s=60", "below step_timeout_s")],
)
def test_bad_latency_fails_on_load_naming_the_key(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(GRPOConfig, None, [f"out={tmp_path}", "env.name=calculator", override])


def test_null_workers_give_every_waiting_episode_a_thread():
    from posttrain.trainers.rl.env_section import DEFAULT_WORKERS, auto_workers, rollout_in_flight

    def cfg(*overrides: str) -> GRPOConfig:
        base = ["env.name=calculator", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]
        return load_config(GRPOConfig, None, [*base, *overrides])

    plain = cfg("data.eval_size=10")
    assert plain.env.workers is None and auto_workers(plain.env, 16) == DEFAULT_WORKERS  # no waits: the default
    assert rollout_in_flight(plain.rollout, 10) == 16 and rollout_in_flight(plain.rollout, 50) == 50  # or the eval's
    slow = cfg("env.tool_latency_s=0.5", "rollout.mode=async", "rollout.max_staleness=2")
    assert rollout_in_flight(slow.rollout, 0) == 48  # this step's 16 and two steps ahead
    assert auto_workers(slow.env, 48) == 48 and auto_workers(slow.env, 2) == DEFAULT_WORKERS
    assert auto_workers(slow.env, 10_000) == 512  # sleeping threads are cheap, not free
    assert auto_workers(cfg("env.tool_latency_s=0.5", "env.workers=3").env, 48) == 3  # a set value wins
    with pytest.raises(ConfigError, match="workers must be >= 1 or null, got 0"):
        cfg("env.workers=0")

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

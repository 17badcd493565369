"""The generic tool environment: opening messages, concurrent calls, parse failures, the end of an episode."""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.envs.builtin_tools import calculator
from posttrain.envs.environment import EnvError, Environment
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.tool_env import ToolEnvironment, opening_messages


def call_text(name, **arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_opening_messages_from_a_string_or_messages():
    assert opening_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert opening_messages({"prompt": "hi"}, "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert opening_messages({"prompt": own}, "sys") == own  # the row's own system message wins
    with pytest.raises(EnvError, match="environment row has no 'prompt' column"):
        opening_messages({"question": "hi"})
    with pytest.raises(EnvError, match="a 'prompt' of type int"):
        opening_messages({"prompt": 3})


def test_an_episode_with_a_call_then_an_answer():
    env = ToolEnvironment([calculator], system_prompt="Use tools.")
    assert isinstance(env, Environment)
    assert [tool.name for tool in env.tools] == ["calculator"]
    assert env.reset({"prompt": "What is 347 times 29?"})[0] == {"role": "system", "content": "Use tools."}
    step = env.step(parse_hermes(call_text("calculator", expression="347 * 29")))
    assert not step.done
    assert step.observations == [{"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "10063"}]
    assert step.counts["tool_calls"] == 1 and step.counts["tool_calls/calculator"] == 1
    assert step.counts["parse_failures"] == 0 and step.counts["tool_errors"] == 0
    last = env.step(parse_hermes("The answer is 10063."))
    assert last.done and last.observations == []
    assert env.episode_reward() is None  # no answer check: the run's reward functions score it


def test_several_calls_run_concurrently_and_answer_in_order():
    started = threading.Barrier(3, timeout=5)  # all three must be running at once to pass the barrier

    def wait(label: str) -> str:
        """Wait for the others, then answer.

        Args:
            label: What to answer.
        """
        started.wait()
        return label

    env = ToolEnvironment([wait])
    env.reset({"prompt": "go"})
    start = time.monotonic()
    step = env.step(
        parse_hermes(call_text("wait", label="a") + call_text("wait", label="b") + call_text("wait", label="c"))
    )
    assert time.monotonic() - start < 5
    assert [m["content"] for m in step.observations] == ["a", "b", "c"]
    assert [m["tool_call_id"] for m in step.observations] == ["call_0", "call_1", "call_2"]
    assert step.counts["tool_calls"] == 3 and step.counts["tool_calls/wait"] == 3


def test_parse_failures_and_unknown_tools_are_observations():
    env = ToolEnvironment([calculator])
    env.reset({"prompt": "go"})
    text = (
        "<tool_call>{not json}</tool_call>" + call_text("search", query="x") + call_text("calculator", expression="2+2")
    )
    step = env.step(parse_hermes(text))
    assert not step.done  # the model gets to read the errors and try again
    contents = [m["content"] for m in step.observations]
    assert contents[0].startswith("Error: unknown tool 'search' (available: calculator)")
    assert contents[1] == "4"
    assert contents[2].startswith("Error: tool call 1: invalid JSON")
    assert "tool_call_id" not in step.observations[2]
    assert step.counts["parse_failures"] == 1 and step.counts["tool_errors"] == 1 and step.counts["tool_calls"] == 2
    assert "tool_calls/(unknown)" in step.counts


def test_only_parse_errors_do_not_end_the_episode():
    env = ToolEnvironment([calculator])
    env.reset({"prompt": "go"})
    step = env.step(parse_hermes('<tool_call>{"arguments": {}}</tool_call>'))
    assert not step.done and step.counts["parse_failures"] == 1 and len(step.observations) == 1


def test_answer_check_scores_the_final_text():
    env = ToolEnvironment([calculator], check_answer=lambda text, row: float(text == row["answer"]))
    env.reset({"prompt": "go", "answer": "4"})
    assert env.episode_reward() == 0.0  # cut short before answering
    env.step(parse_hermes("4"))
    assert env.episode_reward() == 1.0


def test_bad_options():
    with pytest.raises(EnvError, match="tool_timeout_s must be positive"):
        ToolEnvironment([calculator], tool_timeout_s=0)

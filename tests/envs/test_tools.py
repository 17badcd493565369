"""Tools: schemas from signatures, and every way a call can fail turning into an observation and a count."""

from __future__ import annotations

import asyncio
import time

import pytest

from posttrain.envs.tools import MAX_TOOL_OUTPUT_CHARS, ToolError, as_tool, as_tools, run_tool_call
from posttrain.envs.turns import ToolCall


def add(a: int, b: int = 0) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


async def slow_echo(text: str, delay: float = 0.0) -> str:
    """Echo text after a delay.

    Args:
        text: What to echo.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return text


def sleeper(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("disk on fire")


def number(x: int) -> int:
    """Returns an int, not a string.

    Args:
        x: A number.
    """
    return x


TOOLS = {tool.name: tool for tool in as_tools([add, slow_echo, sleeper, broken, number])}


def call(name, **arguments):
    return ToolCall(name=name, arguments=arguments, id="call_3")


def test_schema_from_the_signature():
    tool = as_tool(add)
    assert tool.name == "add" and tool.function is add and not tool.is_async
    assert tool.schema["type"] == "function"
    function = tool.schema["function"]
    assert function["description"] == "Add two integers."
    assert function["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert function["parameters"]["required"] == ["a"]
    assert as_tool(slow_echo).is_async
    assert as_tool(tool) is tool


def test_a_function_without_hints_or_docstring_is_one_clear_error():
    def no_hints(x):
        """Doc.

        Args:
            x: a thing
        """

    def no_doc(x: int) -> str:
        return ""

    with pytest.raises(ToolError, match=r"tool .*no_hints: .*missing a type hint"):
        as_tool(no_hints)
    with pytest.raises(ToolError, match=r"tool .*no_doc: .*no docstring"):
        as_tool(no_doc)
    with pytest.raises(ToolError, match="two tools are named 'add'"):
        as_tools([add, add])


def test_a_good_call():
    message, counts = run_tool_call(TOOLS, call("add", a=2, b=3))
    assert message == {"role": "tool", "tool_call_id": "call_3", "name": "add", "content": "5"}
    assert counts == {"tool_calls": 1, "tool_calls/add": 1, "tool_errors": 0, "tool_timeouts": 0}


def test_an_async_tool():
    message, counts = run_tool_call(TOOLS, call("slow_echo", text="hi"))
    assert message["content"] == "hi" and counts["tool_errors"] == 0


@pytest.mark.parametrize(
    ("the_call", "expected"),
    [
        (call("nope", a=1), "Error: unknown tool 'nope' (available: add, broken, number, sleeper, slow_echo)"),
        (call("add", c=1), "Error: bad arguments for 'add': "),
        (call("add"), "Error: bad arguments for 'add': missing a required argument: 'a'"),
        (call("broken", x=1), "Error: tool 'broken' raised RuntimeError: disk on fire"),
        (call("number", x=1), "Error: tool 'number' returned a int, not a string"),
    ],
)
def test_failures_are_observations(the_call, expected):
    message, counts = run_tool_call(TOOLS, the_call)
    assert message["role"] == "tool" and message["tool_call_id"] == "call_3" and message["name"] == the_call.name
    assert message["content"].startswith(expected)
    assert counts["tool_errors"] == 1 and counts["tool_timeouts"] == 0 and counts["tool_calls"] == 1


def test_an_unknown_name_is_counted_under_one_key():
    _, counts = run_tool_call(TOOLS, call("made_up_name"))
    assert "tool_calls/(unknown)" in counts and "tool_calls/made_up_name" not in counts


@pytest.mark.parametrize("the_call", [call("sleeper", seconds=5.0), call("slow_echo", text="x", delay=5.0)])
def test_a_hung_tool_times_out(the_call):
    start = time.monotonic()
    message, counts = run_tool_call(TOOLS, the_call, timeout_s=0.2)
    assert time.monotonic() - start < 2.0  # the caller stopped waiting (a sync tool's thread runs on, detached)
    assert message["content"] == f"Error: tool '{the_call.name}' timed out after 0.2 s"
    assert counts["tool_timeouts"] == 1 and counts["tool_errors"] == 1


def test_a_timeout_error_raised_by_the_tool_is_not_a_timeout():
    def raises_timeout(x: int) -> str:
        """Raises TimeoutError itself.

        Args:
            x: Ignored.
        """
        raise TimeoutError("upstream")

    message, counts = run_tool_call({"raises_timeout": as_tool(raises_timeout)}, call("raises_timeout", x=1))
    assert counts["tool_timeouts"] == 0 and "raised TimeoutError: upstream" in message["content"]


def test_long_output_is_cut():
    message, _ = run_tool_call(TOOLS, call("slow_echo", text="y" * (MAX_TOOL_OUTPUT_CHARS + 50)))
    assert message["content"].startswith("y" * MAX_TOOL_OUTPUT_CHARS)
    assert message["content"].endswith("(cut: 50 more characters)")


def test_an_async_tool_from_inside_a_running_loop():
    async def main():
        return run_tool_call(TOOLS, call("slow_echo", text="nested"))

    message, _ = asyncio.run(main())
    assert message["content"] == "nested"

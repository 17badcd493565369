"""Tools: plain Python functions the model may call, their JSON schemas, and running one call safely.

A tool is a function with type hints and a Google-style docstring (a description, and one line per argument
under `Args:`), sync or `async def`. Its schema, in OpenAI's function format, comes from the signature through
`transformers.utils.get_json_schema` (the `agents` extra), the same schema TRL and HF chat templates use:

    def add(a: int, b: int) -> str:
        '''Add two integers.

        Args:
            a: The first number.
            b: The second number.
        '''
        return str(a + b)

    tool = as_tool(add)     # Tool(name="add", function=add, schema={...}, is_async=False)

`run_tool_call` turns one `ToolCall` into the tool message the model sees next. Nothing a tool does escapes it:
an unknown name, arguments the signature does not take, an exception, a non-string result, or a call past its
timeout each become an error observation ("Error: ...") and a count.

Timeouts: an async tool is cancelled at the timeout (asyncio.wait_for). A sync tool runs in a worker thread and
the caller stops waiting at the timeout; Python cannot stop a thread, so a hung sync tool keeps its thread until
it returns (its result is dropped). Tools that may hang for good should be async or run a subprocess with its
own limit (as the `python` built-in does through the reward sandbox).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.envs.environment import Message
from posttrain.envs.turns import ToolCall
from posttrain.errors import PosttrainError

DEFAULT_TOOL_TIMEOUT_S = 10.0
MAX_TOOL_OUTPUT_CHARS = 4000  # a tool's answer beyond this is cut: it is prompt tokens in the next turn


class ToolError(PosttrainError):
    """A function that cannot be a tool (no type hints or docstring for its schema), named with the reason."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: `schema` is {"type": "function", "function": {"name", "description", "parameters"}}."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool


def as_tool(function: Callable[..., Any] | Tool, *, where: str | None = None) -> Tool:
    """`function` as a Tool (a Tool is returned as is). `where` names it in errors (default: its qualified name)."""
    if isinstance(function, Tool):
        return function
    if not callable(function):
        raise ToolError(f"tool {function!r}: not a function")
    where = where or getattr(function, "__qualname__", repr(function))
    schema = function_schema(function, where)
    return Tool(schema["function"]["name"], function, schema, _is_async(function))


def as_tools(functions: Iterable[Callable[..., Any] | Tool]) -> list[Tool]:
    """Tools from functions; two tools of one name are an error (the model could not tell them apart)."""
    tools = [as_tool(function) for function in functions]
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ToolError(f"two tools are named {tool.name!r}; tool names must be unique")
        seen.add(tool.name)
    return tools


def function_schema(function: Callable[..., Any], where: str) -> dict[str, Any]:
    """The OpenAI function schema of `function`, or ToolError naming `where` and what is missing."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise ToolError(f"tool {where}: tool schemas need transformers (pip install 'posttrain[agents]')") from None
    try:
        return get_json_schema(function)
    except Exception as error:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ToolError(
            f"tool {where}: {error} (a tool needs type hints and a docstring with an Args: section)"
        ) from None


def _is_async(function: Callable[..., Any]) -> bool:
    # a callable object with an `async def __call__` is async too
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(type(function).__call__)


def tool_message(call: ToolCall, content: str) -> Message:
    """The message answering `call` (OpenAI's shape: role "tool", the call's id and the tool's name)."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def run_tool_call(
    tools_by_name: Mapping[str, Tool], call: ToolCall, timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
) -> tuple[Message, dict[str, float]]:
    """Run one call: (the tool message, its counts). Never raises for anything the tool or the call does.

    Counts: `tool_calls` and `tool_calls/<name>` (1 each), `tool_errors` (1 for an unknown tool, bad
    arguments, an exception or a non-string result), `tool_timeouts` (1 when the call ran past `timeout_s`)."""
    tool = tools_by_name.get(call.name)
    # An unknown name is counted under one key: the model's made-up names must not grow the metric set.
    per_tool = f"tool_calls/{call.name}" if tool is not None else "tool_calls/(unknown)"
    counts = {"tool_calls": 1.0, per_tool: 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
    if tool is None:
        known = ", ".join(sorted(tools_by_name)) or "none"
        return _failed(call, counts, f"unknown tool {call.name!r} (available: {known})")
    problem = _argument_problem(tool, call.arguments)
    if problem:
        return _failed(call, counts, problem)
    try:
        result = _call_with_timeout(tool, call.arguments, timeout_s)
    except _TimedOut:
        counts["tool_timeouts"] = 1.0
        return _failed(call, counts, f"tool {call.name!r} timed out after {timeout_s:g} s")
    except Exception as error:
        return _failed(call, counts, f"tool {call.name!r} raised {type(error).__name__}: {error}")
    if not isinstance(result, str):
        return _failed(call, counts, f"tool {call.name!r} returned a {type(result).__name__}, not a string")
    return tool_message(call, _clipped(result)), counts


def _failed(call: ToolCall, counts: dict[str, float], reason: str) -> tuple[Message, dict[str, float]]:
    counts["tool_errors"] = 1.0
    return tool_message(call, f"Error: {reason}"), counts


def _argument_problem(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` cannot be bound to the tool's signature (unknown or missing names), or None."""
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as error:
        expected = ", ".join(tool.schema["function"].get("parameters", {}).get("properties", {})) or "none"
        return f"bad arguments for {tool.name!r}: {error} (parameters: {expected})"
    return None


class _TimedOut(Exception):
    """The call ran past its timeout (distinct from a TimeoutError the tool itself raises)."""


def _call_with_timeout(tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> Any:
    if tool.is_async:
        return run_coroutine(lambda: _awaited_within(tool.function(**arguments), timeout_s))
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = tool.function(**arguments)
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    # A daemon thread: a tool that never returns must not keep the process alive at exit.
    worker = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _TimedOut
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


async def _awaited_within(coroutine: Any, timeout_s: float) -> Any:
    task = asyncio.ensure_future(coroutine)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise _TimedOut
    return task.result()


def run_coroutine(make: Callable[[], Any]) -> Any:
    """Run the coroutine `make()` returns to its end from sync code, also when this thread runs an event loop
    (then in a thread of its own: asyncio.run cannot nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(make())
        except BaseException as error:
            box["error"] = error

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _clipped(text: str) -> str:
    if len(text) <= MAX_TOOL_OUTPUT_CHARS:
        return text
    return text[:MAX_TOOL_OUTPUT_CHARS] + f"\n... (cut: {len(text) - MAX_TOOL_OUTPUT_CHARS} more characters)"

"""Tool-call parsers: a sampled model turn -> `ParsedTurn` (the calls, the text around them, what failed).

A parser is `parse(text: str, first_call_index: int = 0) -> ParsedTurn`; call ids are `call_<k>` counting up
from `first_call_index` (the rollout passes the episode's count so ids stay unique across turns). Parsers are
chosen by name from `TOOL_CALL_PARSERS` (add one with `register_tool_call_parser`), or given as
`path/to/file.py:function` / `package.module:function`.

`hermes` reads the format of the `chatml_tools` template (Hermes / Qwen2.5): one JSON object per call,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347 * 29"}}
    </tool_call>

several per turn. A call whose JSON is malformed, has no name, or whose arguments are not an object becomes
one line in `errors` and no call. Arguments given as a JSON string (OpenAI's wire format) are decoded. A last
`<tool_call>` left open at the end of the turn is read too: generation often stops on `</tool_call>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from posttrain.envs.turns import ParsedTurn, ToolCall
from posttrain.errors import PosttrainError
from posttrain.imports import is_import_spec, load_object

ToolCallParser = Callable[..., ParsedTurn]  # (text, first_call_index=0) -> ParsedTurn

_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_ERROR_SNIPPET_CHARS = 80


def parse_hermes(text: str, first_call_index: int = 0) -> ParsedTurn:
    """Hermes / Qwen2.5 `<tool_call>{json}</tool_call>` blocks (see the module docstring)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for number, match in enumerate(_HERMES_CALL.finditer(text), start=1):
        call, error = _hermes_call(match.group(1), f"call_{first_call_index + len(calls)}")
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {error}")
    content = _HERMES_CALL.sub("", text).strip()
    return ParsedTurn(text=text, content=content, tool_calls=calls, errors=errors)


def _hermes_call(body: str, call_id: str) -> tuple[ToolCall | None, str]:
    snippet = body.strip()[:_ERROR_SNIPPET_CHARS]
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return None, f"invalid JSON ({error.msg} at character {error.pos}): {snippet!r}"
    if not isinstance(value, dict):
        return None, f"expected a JSON object with 'name' and 'arguments', got {type(value).__name__}: {snippet!r}"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"no 'name' string: {snippet!r}"
    arguments: Any = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire format carries arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return None, f"'arguments' of {name!r} is a string but not JSON ({error.msg})"
    if not isinstance(arguments, dict):
        return None, f"'arguments' of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name.strip(), arguments=arguments, id=call_id), ""


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes}


def register_tool_call_parser(name: str, parser: ToolCallParser) -> None:
    """Make `parser` available as `get_tool_call_parser(name)` (replacing a parser of that name)."""
    if not callable(parser):
        raise PosttrainError(f"tool-call parser {name!r}: {parser!r} is not callable")
    TOOL_CALL_PARSERS[name] = parser


def get_tool_call_parser(name: str = "hermes") -> ToolCallParser:
    """The parser registered as `name`, or the function a `file.py:function` / `module:function` spec names."""
    if name in TOOL_CALL_PARSERS:
        return TOOL_CALL_PARSERS[name]
    if not is_import_spec(name):
        raise PosttrainError(
            f"unknown tool-call parser {name!r} (choose from {', '.join(TOOL_CALL_PARSERS)}, "
            "or give path/to/file.py:function or package.module:function)"
        )
    parser = load_object(name, "tool-call parser")
    if not callable(parser):
        raise PosttrainError(f"tool-call parser {name!r} is a {type(parser).__name__}, not a function")
    return parser

"""Row validation: the checks one row must pass, and the log of rows that failed them.

A bad row never stops a run by itself. Each one is reported (a warning naming `file:line` and the
reason), counted and skipped; only when the bad rows exceed a fraction of all rows read does the
run abort, with one error that names the count, the threshold and the first few offenders. A
dataset with a handful of broken lines still trains; a file in the wrong format fails at once.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.errors import PosttrainError

logger = logging.getLogger("posttrain.data")

KNOWN_ROLES = ("system", "user", "assistant", "tool")

# Which role may follow which (after an optional leading system message). A tool result answers an
# assistant tool call and is answered by the assistant (or by another tool result).
ALLOWED_NEXT: dict[str | None, tuple[str, ...]] = {
    None: ("user",),  # the first non-system message
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("tool", "assistant"),
}


class DataError(PosttrainError):
    """A dataset that cannot be used: unreadable, the wrong format, or too many bad rows."""


class RowError(ValueError):
    """One row is unusable; the message is the reason. The caller adds the row's location."""


@dataclass(frozen=True)
class BadRow:
    location: str  # "train.jsonl:17" for line-based files, "train.parquet:row 17" for columnar ones
    reason: str


# ----------------------------------------------------------------------------- checks on one row


def require_field(row: Mapping[str, Any], name: str) -> Any:
    if name not in row:
        raise RowError(f"missing field {name!r} (row has: {', '.join(map(repr, row)) or 'no fields'})")
    value = row[name]
    if value is None:
        raise RowError(f"field {name!r} is null")
    return value


def check_text(value: Any, field: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise RowError(f"field {field!r} must be a string or a list of messages, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise RowError(f"empty {field} (nothing to train on)")
    return value


def check_messages(messages: Any, field: str) -> list[dict[str, Any]]:
    """A list of {"role", "content"} dicts with known roles; returns plain dicts. Order is checked apart."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise RowError(f"field {field!r} must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise RowError(f"field {field!r} has no messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RowError(f"{field}[{i}] must be a message object, got {type(message).__name__}")
        role = message.get("role")
        if role not in KNOWN_ROLES:
            shown = "no role" if role is None else f"unknown role {role!r}"
            raise RowError(f"{field}[{i}] has {shown} (expected one of {', '.join(KNOWN_ROLES)})")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            got = "no content" if content is None else f"content of type {type(content).__name__}"
            raise RowError(f"{field}[{i}] ({role}) has {got}; text content is required")
        out.append(dict(message))
    return out


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A row's optional `tools` column: OpenAI function schemas ({"type": "function", "function": {"name", ...}}),
    as a list or a JSON string of one (how HF datasets often store them); None when absent."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise RowError(f"field 'tools' is a string but not JSON ({error.msg})") from None
    if not isinstance(tools, list):
        raise RowError(f"field 'tools' must be a list of function schemas, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RowError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
    return [dict(tool) for tool in tools]


def check_turn_order(messages: Sequence[Mapping[str, Any]], field: str) -> None:
    """System first if at all, then user and assistant alternating (tool results after assistant calls)."""
    previous: str | None = None
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            if i != 0:
                raise RowError(f"{field}[{i}]: a system message is only allowed first")
            continue
        if role not in ALLOWED_NEXT[previous]:
            after = f"after {previous!r}" if previous else "as the first turn"
            raise RowError(
                f"{field}[{i}]: roles do not alternate: {role!r} {after} "
                f"(expected {' or '.join(map(repr, ALLOWED_NEXT[previous]))})"
            )
        previous = role


def check_completion_messages(messages: Sequence[Mapping[str, Any]], field: str) -> None:
    """A completion starts with the assistant and has some assistant text to train on."""
    if messages[0]["role"] != "assistant":
        raise RowError(f"{field} must start with an assistant message, got {messages[0]['role']!r}")
    if not any(m["role"] == "assistant" and (m.get("content") or "").strip() for m in messages):
        raise RowError(f"empty {field} (the assistant message has no text)")


def check_distinct_completions(chosen: Any, rejected: Any) -> None:
    """A pair whose two completions are the same (strings, or message lists compared message by
    message) prefers nothing: every preference format goes through this one check, with one reason."""
    if chosen == rejected:
        raise RowError("chosen and rejected are identical")


# ----------------------------------------------------------------------------- the bad-row log


class BadRowLog:
    """Collects bad rows; warns about each (the first `max_warnings` one by one, then a count)."""

    def __init__(self, max_warnings: int = 20) -> None:
        self.rows: list[BadRow] = []
        self.max_warnings = max_warnings

    def add(self, location: str, reason: str) -> None:
        self.rows.append(BadRow(location, reason))
        if len(self.rows) <= self.max_warnings:
            logger.warning("skipping bad row %s: %s", location, reason)
        elif len(self.rows) == self.max_warnings + 1:
            logger.warning("more bad rows follow; they are counted and summarised at the end, not shown one by one")

    def __len__(self) -> int:
        return len(self.rows)

    def reasons(self) -> Counter[str]:
        """Reason -> count, with row-specific details (field indices, lengths) kept, so similar ones may differ."""
        return Counter(row.reason for row in self.rows)

    def check_fraction(self, source: str, total_rows: int, max_fraction: float) -> None:
        """Raise DataError when more than `max_fraction` of `total_rows` were bad (or none were good)."""
        bad = len(self.rows)
        if total_rows == 0:
            raise DataError(f"{source}: no rows")
        if bad > max_fraction * total_rows or bad == total_rows:
            first = "; ".join(f"{row.location}: {row.reason}" for row in self.rows[:3])
            raise DataError(
                f"{source}: {bad} of {total_rows} rows are bad ({bad / total_rows:.1%}), above "
                f"max_bad_row_fraction={max_fraction:g}. First: {first}"
            )
        if bad:
            logger.warning("%s: skipped %d of %d rows (%.2f%%) as bad", source, bad, total_rows, 100 * bad / total_rows)

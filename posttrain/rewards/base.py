"""What every reward function shares: its type, its error, and how a completion becomes text.

A reward function is called once per batch, with keywords, as TRL calls it:

    fn(prompts=prompts, completions=completions, **columns) -> list[float | None]

`prompts` / `completions` are strings, or chat message lists for conversational data (a completion is
then `[{"role": "assistant", "content": "..."}]`). `columns` are the dataset's other columns, each a
list aligned with the batch. A function may be `async def`. `None` marks a sample it cannot score.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from posttrain.errors import PosttrainError

RewardValues = Sequence[float | None]
RewardFn = Callable[..., RewardValues | Awaitable[RewardValues]]


class RewardError(PosttrainError):
    """A reward spec, file or function that cannot be used as written (names the spec / file / function)."""


def message_text(message: Any) -> str:
    """The text of one chat message: its string content, or the text parts of a multi-part content."""
    if not isinstance(message, Mapping):
        raise TypeError(f"a chat message must be a dict with 'content', got {type(message).__name__}")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, {"type": "image"}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    raise TypeError(f"chat message 'content' must be a string or a list of parts, got {type(content).__name__}")


def completion_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """A completion as plain text: the string itself, or the joined contents of its messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence):
        return "".join(message_text(message) for message in completion)
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")

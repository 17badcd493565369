"""A model turn after tool-call parsing: the calls it makes, its other text, and what could not be parsed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its JSON arguments. `id` is unique within the episode
    (`call_<k>`), and the tool message that answers it carries it as `tool_call_id`, as in OpenAI's API."""

    name: str
    arguments: dict[str, Any]
    id: str

    def as_openai(self) -> dict[str, Any]:
        """The call in an assistant message's `tool_calls` (arguments as a JSON object, which HF chat
        templates expect; OpenAI's wire format carries them as a JSON string, which serve writes)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """A sampled model turn. `text` is the turn as decoded; `content` the text outside the tool-call markup;
    `errors` one line per call that could not be parsed (bad JSON, no name): the environment answers each
    with an error observation the model sees, and the rollout counts them as parse failures."""

    text: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        """The assistant message this turn adds to the conversation (for templates and rewards)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        return message

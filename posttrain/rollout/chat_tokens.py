"""Token ids of a growing conversation without ever re-tokenizing its history.

An episode is one token sequence. Its opening is the chat template applied to the opening messages (with the
tools' schemas and the assistant generation prompt). The model's turns are its sampled tokens, kept as
sampled. What an environment answers is appended as a *template delta*: the conversation is rendered as text
with and without the new messages and only the difference is tokenized, together with whatever the template
writes after an assistant turn's end-of-turn token (ChatML's newline) and the next generation prompt:

    render(history + observations, generation prompt)  =  render(history)  +  delta
    observation tokens  =  encode(tail of the last assistant turn after its end token  +  delta)

So the trainer trains on exactly what the model saw, even where re-encoding a sampled turn's text would give
other ids (BPE has many spellings of one string) or a template renders a parsed tool call in other words than
the model wrote it. A template that rewrites earlier messages once more follow (the render of the history is
not a prefix of the longer one) cannot be used this way, and is refused with one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.errors import PosttrainError

Message = dict[str, Any]


class ChatTokens:
    """Renders an episode's opening and its observation deltas with one tokenizer, template and tool list."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) or None  # no tools: the template's tool-free rendering

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, tools=self.tools
        )

    def opening_ids(self, messages: Sequence[Message]) -> list[int]:
        """The prompt: the opening messages, the tools, and the assistant generation prompt."""
        return self.tokenizer.encode(self.render(messages, add_generation_prompt=True), add_special_tokens=False)

    def observation_ids(self, history: Sequence[Message], observations: Sequence[Message], end_text: str) -> list[int]:
        """The tokens that follow the model's last turn (the last message of `history`, whose sampled tokens end
        with the end-of-turn token whose text is `end_text`; "" for none) when `observations` are appended: the
        template's tail after that token, the observations, and the next assistant generation prompt."""
        before = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *observations], add_generation_prompt=True)
        if not after.startswith(before):
            raise PosttrainError(
                "the chat template renders the earlier messages differently once observations follow, so an "
                "episode cannot grow token by token; choose a template that only appends (model.chat_template)"
            )
        end = before.rfind(end_text) if end_text else -1
        tail = before[end + len(end_text) :] if end >= 0 else ""
        return self.tokenizer.encode(tail + after[len(before) :], add_special_tokens=False)

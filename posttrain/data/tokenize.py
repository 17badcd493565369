"""Examples -> token ids with a loss mask (labels are the ids where the loss applies, -100 elsewhere).

How the masks are found (the same for every chat template, no `{% generation %}` tags needed):

- prompt-completion, conversational: render the prompt with the generation header
  (`add_generation_prompt=True`) and the whole prompt+completion without it. The completion is
  everything after the prompt ids, i.e. the assistant text, the end-of-turn token and whatever the
  template writes after it. This is TRL's rule.
- prompt-completion, plain strings: tokenize the prompt and prompt+completion (with the
  tokenizer's special tokens, as TRL does) and append EOS if the completion does not end with it.
- conversational `messages`, multi-turn: render the whole conversation once. For each assistant
  message i, render messages[:i] with the generation header (where the turn's text starts) and
  messages[:i+1] without it (where the turn ends); the ids in between are that assistant turn. Every
  turn is trained, each including its end-of-turn token.
- language modelling `text`: every token, with EOS appended.

Each boundary relies on the *prefix property*: the ids of the shorter rendering are a prefix of the
ids of the longer one. Most templates have it; one that rewrites earlier turns (e.g. drops past
reasoning) or a tokenizer that merges tokens across the boundary does not. Then the boundary is
taken where the two id lists first differ (TRL does the same) and a warning says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.data.formats import (
    Conversation,
    Example,
    Message,
    Preference,
    PromptCompletion,
    Text,
    UnpairedPreference,
)
from posttrain.data.validate import RowError

logger = logging.getLogger("posttrain.data")

IGNORE_INDEX = -100


class ChatTokenizer(Protocol):
    """What tokenization needs; `posttrain.tokenizer.Tokenizer` provides it."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, tokenize: bool = True, **kwargs: Any
    ) -> list[int] | str: ...


@dataclass
class TokenizedRow:
    """One training sequence. labels[t] = input_ids[t] where the loss applies, else -100 (unshifted,
    as in transformers: the collator shifts them into next-token targets)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        """Tokens the loss is computed on: labels after the first position (nothing predicts token 0)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_warned_prefix = False


def _warn_prefix_once() -> None:
    global _warned_prefix
    if not _warned_prefix:
        _warned_prefix = True
        logger.warning(
            "the tokenized prompt is not a prefix of the tokenized prompt+completion (the chat template "
            "renders it differently, or tokens merge across the boundary); the loss mask starts where they "
            "differ. Shown once; it may apply to every row."
        )


def _render(
    tokenizer: ChatTokenizer, messages: Sequence[Message], add_generation_prompt: bool, tools: Any = None
) -> list[int]:
    extra = {} if tools is None else {"tools": tools}  # only when given: a tokenizer without tools= still works
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    return list(ids)  # type: ignore[arg-type]


def _masked_after(tokenizer: ChatTokenizer, prompt_ids: list[int], full_ids: list[int]) -> TokenizedRow:
    start = common_prefix_length(prompt_ids, full_ids)
    if start < len(prompt_ids):
        _warn_prefix_once()
    return TokenizedRow(full_ids, [IGNORE_INDEX] * start + full_ids[start:])


def _with_eos(tokenizer: ChatTokenizer, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise RowError("the tokenizer has no EOS token to end a plain-text completion with")
    return ids if ids and ids[-1] == eos else ids + [eos]


def tokenize_prompt_completion(tokenizer: ChatTokenizer, example: PromptCompletion) -> TokenizedRow:
    if isinstance(example.prompt, list):
        prompt_ids = _render(tokenizer, example.prompt, add_generation_prompt=True)
        full_ids = _render(tokenizer, example.prompt + example.completion, add_generation_prompt=False)  # type: ignore[operator]
    else:
        prompt_ids = tokenizer.encode(example.prompt, add_special_tokens=True)
        full_ids = _with_eos(tokenizer, tokenizer.encode(example.prompt + example.completion, add_special_tokens=True))  # type: ignore[operator]
    return _masked_after(tokenizer, prompt_ids, full_ids)


def tokenize_conversation(tokenizer: ChatTokenizer, example: Conversation) -> TokenizedRow:
    """Assistant-only labels for a multi-turn chat (see the module docstring for the method)."""
    messages, tools = example.messages, example.tools
    full_ids = _render(tokenizer, messages, add_generation_prompt=False, tools=tools)
    labels = [IGNORE_INDEX] * len(full_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        start = common_prefix_length(before, full_ids)
        end = common_prefix_length(through, full_ids)
        if start < len(before) or end < len(through):
            _warn_prefix_once()
        labels[start:end] = full_ids[start:end]
    return TokenizedRow(full_ids, labels)


def tokenize_text(tokenizer: ChatTokenizer, example: Text) -> TokenizedRow:
    ids = _with_eos(tokenizer, tokenizer.encode(example.text, add_special_tokens=True))
    return TokenizedRow(ids, list(ids))


def tokenize_sft(tokenizer: ChatTokenizer, example: Example, completion_only: bool = True) -> TokenizedRow:
    """Token ids and labels of one example for SFT. A preference example trains on prompt + chosen.
    With `completion_only=False` every token is a label."""
    if isinstance(example, Preference):
        example = PromptCompletion(example.prompt, example.chosen)
    if isinstance(example, PromptCompletion):
        row = tokenize_prompt_completion(tokenizer, example)
    elif isinstance(example, Conversation):
        row = tokenize_conversation(tokenizer, example)
    elif isinstance(example, Text):
        row = tokenize_text(tokenizer, example)
    elif isinstance(example, UnpairedPreference):
        raise TypeError("unpaired preference (KTO) rows have no SFT target; use a KTO trainer")
    else:
        raise TypeError(f"not an example: {type(example).__name__}")
    if not completion_only:
        row.labels = list(row.input_ids)
    return row


def fit_to_length(row: TokenizedRow, max_length: int, overlong: str) -> TokenizedRow:
    """Enforce `max_length`: "skip" rejects a longer row, "truncate" keeps its first max_length ids.
    A row left with no labels is rejected either way (it would train on nothing)."""
    if len(row) > max_length:
        if overlong == "skip":
            raise RowError(f"too long: {len(row)} tokens > max_length {max_length} (data.overlong=skip)")
        row = TokenizedRow(row.input_ids[:max_length], row.labels[:max_length])
        if row.num_targets == 0:
            raise RowError(f"no completion tokens within max_length {max_length} after truncation")
    elif row.num_targets == 0:
        raise RowError("no completion tokens after tokenization")
    return row

"""Row formats, as TRL defines them, parsed into typed examples.

| format                | fields                                   | example type        |
|-----------------------|------------------------------------------|---------------------|
| `prompt_completion`   | prompt, completion                       | PromptCompletion    |
| `conversational`      | messages (+ tools)                       | Conversation        |
| `language_modeling`   | text                                     | Text                |
| `preference`          | prompt, chosen, rejected                 | Preference          |
| `implicit_preference` | chosen, rejected (shared prefix = prompt) | Preference          |
| `unpaired_preference` | prompt, completion, label (KTO)          | UnpairedPreference  |
| `hh_rlhf`             | chosen, rejected as "\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts | Preference |

`prompt`, `completion`, `chosen` and `rejected` are each either a string ("standard") or a list of
`{"role", "content"}` messages ("conversational"); the fields of one row must agree. Every parser
checks its row and raises `RowError` with the reason; `detect_format` picks a format from the keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.data.validate import (
    RowError,
    check_completion_messages,
    check_distinct_completions,
    check_messages,
    check_text,
    check_tools,
    check_turn_order,
    require_field,
)

Message = dict[str, Any]
Turns = str | list[Message]  # a plain string, or chat messages


@dataclass(frozen=True)
class PromptCompletion:
    prompt: Turns
    completion: Turns


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None  # the row's `tools` schemas, rendered by the chat template (as TRL)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Preference:
    prompt: Turns
    chosen: Turns
    rejected: Turns


@dataclass(frozen=True)
class UnpairedPreference:
    prompt: Turns
    completion: Turns
    label: bool  # True: a desirable completion


Example = PromptCompletion | Conversation | Text | Preference | UnpairedPreference


def is_conversational(turns: Turns) -> bool:
    return isinstance(turns, list)


# ----------------------------------------------------------------------------- one parser per format


def _prompt_and_completion(row: Mapping[str, Any], completion_field: str) -> tuple[Turns, Turns]:
    """The prompt and one completion field of a row, checked together."""
    prompt = require_field(row, "prompt")
    completion = require_field(row, completion_field)
    for name, value in (("prompt", prompt), (completion_field, completion)):
        if not isinstance(value, (str, list)):
            raise RowError(f"field {name!r} must be a string or a list of messages, got {type(value).__name__}")
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        if not isinstance(completion, str):
            raise RowError(
                f"prompt is a string but {completion_field!r} is {type(completion).__name__}; "
                "use strings for both or message lists for both"
            )
        return prompt, check_text(completion, completion_field, allow_empty=False)
    prompt_messages = check_messages(prompt, "prompt")
    if isinstance(completion, str):
        raise RowError(
            f"prompt is a message list but {completion_field!r} is a string; "
            "use strings for both or message lists for both"
        )
    completion_messages = check_messages(completion, completion_field)
    check_completion_messages(completion_messages, completion_field)
    check_turn_order(prompt_messages + completion_messages, f"prompt+{completion_field}")
    return prompt_messages, completion_messages


def parse_prompt_completion(row: Mapping[str, Any]) -> PromptCompletion:
    return PromptCompletion(*_prompt_and_completion(row, "completion"))


def parse_conversational(row: Mapping[str, Any]) -> Conversation:
    messages = check_messages(require_field(row, "messages"), "messages")
    check_turn_order(messages, "messages")
    if not any(m["role"] == "assistant" and (m.get("content") or "").strip() for m in messages):
        raise RowError("empty completion: no assistant message with text to train on")
    return Conversation(messages, check_tools(row.get("tools")))


def parse_language_modeling(row: Mapping[str, Any]) -> Text:
    return Text(check_text(require_field(row, "text"), "text", allow_empty=False))


def parse_preference(row: Mapping[str, Any]) -> Preference:
    """The explicit format, and the funnel of the implicit and hh formats once their prompt is split off."""
    prompt, chosen = _prompt_and_completion(row, "chosen")
    _, rejected = _prompt_and_completion(row, "rejected")
    check_distinct_completions(chosen, rejected)
    return Preference(prompt, chosen, rejected)


def parse_implicit_preference(row: Mapping[str, Any]) -> Preference:
    chosen, rejected = require_field(row, "chosen"), require_field(row, "rejected")
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen_rest, rejected_rest = split_shared_text(chosen, rejected)
        return parse_preference({"prompt": prompt, "chosen": chosen_rest, "rejected": rejected_rest})
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise RowError("'chosen' and 'rejected' must both be strings or both be message lists")
    chosen_messages = check_messages(chosen, "chosen")
    rejected_messages = check_messages(rejected, "rejected")
    prompt, chosen_rest, rejected_rest = split_shared_messages(chosen_messages, rejected_messages)
    return parse_preference({"prompt": prompt, "chosen": chosen_rest, "rejected": rejected_rest})


def parse_unpaired_preference(row: Mapping[str, Any]) -> UnpairedPreference:
    prompt, completion = _prompt_and_completion(row, "completion")
    label = require_field(row, "label")
    if isinstance(label, bool):
        return UnpairedPreference(prompt, completion, label)
    if isinstance(label, int) and label in (0, 1):
        return UnpairedPreference(prompt, completion, bool(label))
    raise RowError(f"field 'label' must be true/false, got {label!r}")


def parse_hh_rlhf(row: Mapping[str, Any]) -> Preference:
    chosen = parse_hh_transcript(check_text(require_field(row, "chosen"), "chosen"), "chosen")
    rejected = parse_hh_transcript(check_text(require_field(row, "rejected"), "rejected"), "rejected")
    prompt, chosen_rest, rejected_rest = split_shared_messages(chosen, rejected)
    return parse_preference({"prompt": prompt, "chosen": chosen_rest, "rejected": rejected_rest})


FORMATS: dict[str, Callable[[Mapping[str, Any]], Example]] = {
    "prompt_completion": parse_prompt_completion,
    "conversational": parse_conversational,
    "language_modeling": parse_language_modeling,
    "preference": parse_preference,
    "implicit_preference": parse_implicit_preference,
    "unpaired_preference": parse_unpaired_preference,
    "hh_rlhf": parse_hh_rlhf,
}


def detect_format(row: Mapping[str, Any]) -> str | None:
    """The format a row's keys imply, or None. Extra keys are ignored (TRL keeps them too)."""
    keys = set(row)
    if "messages" in keys:
        return "conversational"
    if {"chosen", "rejected"} <= keys:
        if "prompt" in keys:
            return "preference"
        if all(isinstance(row[k], str) and _HH_MARKER.search(row[k]) for k in ("chosen", "rejected")):
            return "hh_rlhf"
        return "implicit_preference"
    if {"prompt", "completion", "label"} <= keys:
        return "unpaired_preference"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "text" in keys:
        return "language_modeling"
    return None


# ----------------------------------------------------------------------------- shared-prompt splitting

_HH_MARKER = re.compile(r"(?:^|\n\n)(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh_transcript(text: str, field: str) -> list[Message]:
    """ "\\n\\nHuman: hi\\n\\nAssistant: hello" -> [{"role": "user", ...}, {"role": "assistant", ...}].

    A turn starts at "\\n\\nHuman:" / "\\n\\nAssistant:" (or at the very start of the text); its content
    runs to the next turn marker, stripped of surrounding whitespace. The turns must alternate.
    """
    pieces = _HH_MARKER.split(text)  # [before, role, content, role, content, ...]
    if pieces[0].strip():
        raise RowError(f"{field}: text before the first 'Human:' turn: {pieces[0][:40]!r}")
    if len(pieces) < 3:
        raise RowError(f"{field}: no 'Human:' / 'Assistant:' turns found")
    messages = [{"role": _HH_ROLES[pieces[i]], "content": pieces[i + 1].strip()} for i in range(1, len(pieces), 2)]
    check_turn_order(messages, field)
    return messages


def split_shared_messages(
    chosen: list[Message], rejected: list[Message]
) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen_rest, rejected_rest): the longest shared message prefix that ends before an
    assistant turn, and what follows it in each. TRL's `extract_prompt` rule, plus the guarantee that
    both completions start with the assistant."""
    check_distinct_completions(chosen, rejected)  # before splitting: an identical pair has no split point
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared > 0 and chosen[shared - 1]["role"] == "assistant":
        shared -= 1  # an identical assistant turn belongs to both completions, not the prompt
    if shared == 0:
        raise RowError("chosen and rejected share no prompt (they differ from the first message)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def split_shared_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen_rest, rejected_rest) for plain strings: the common prefix, cut back to a word
    boundary so each completion starts with the whitespace before its first differing word (tokens
    such as " blue" then stay whole)."""
    check_distinct_completions(chosen, rejected)
    i = 0
    while i < min(len(chosen), len(rejected)) and chosen[i] == rejected[i]:
        i += 1
    while i > 0 and not chosen[i - 1].isspace():
        i -= 1
    while i > 0 and chosen[i - 1].isspace():
        i -= 1
    if i == 0:
        raise RowError("chosen and rejected share no prompt (they differ in the first word)")
    return chosen[:i], chosen[i:], rejected[i:]


def to_chat(example: Example) -> Example:
    """Plain-string prompt/completion examples as a one-turn chat (user prompt, assistant answer), so
    the model's chat template applies. Conversational examples and `text` rows are returned as is."""

    def user(turns: Turns) -> Turns:
        return [{"role": "user", "content": turns}] if isinstance(turns, str) else turns

    def assistant(turns: Turns) -> Turns:
        return [{"role": "assistant", "content": turns}] if isinstance(turns, str) else turns

    if isinstance(example, PromptCompletion):
        return PromptCompletion(user(example.prompt), assistant(example.completion))
    if isinstance(example, Preference):
        return Preference(user(example.prompt), assistant(example.chosen), assistant(example.rejected))
    if isinstance(example, UnpairedPreference):
        return UnpairedPreference(user(example.prompt), assistant(example.completion), example.label)
    return example

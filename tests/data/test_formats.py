"""Row formats: detection, parsing, the checks each row must pass, shared-prompt splitting."""

from __future__ import annotations

import json

import pytest

from posttrain.data.formats import (
    FORMATS,
    Conversation,
    Preference,
    PromptCompletion,
    Text,
    UnpairedPreference,
    detect_format,
    parse_hh_transcript,
    split_shared_text,
    to_chat,
)
from posttrain.data.validate import RowError

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"prompt": "2+2=", "completion": "4"}, "prompt_completion"),
        ({"prompt": [U("hi")], "completion": [A("yo")]}, "prompt_completion"),
        ({"messages": [U("hi"), A("yo")]}, "conversational"),
        ({"text": "plain text"}, "language_modeling"),
        ({"prompt": "q", "chosen": " a", "rejected": " b"}, "preference"),
        ({"chosen": "q a", "rejected": "q b"}, "implicit_preference"),
        ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"}, "hh_rlhf"),
        ({"prompt": "q", "completion": "a", "label": True}, "unpaired_preference"),
        ({"question": "q", "answer": "a"}, None),
    ],
)
def test_detect_format(row, fmt):
    assert detect_format(row) == fmt


def test_each_format_parses_to_its_example():
    assert FORMATS["prompt_completion"]({"prompt": "2+2=", "completion": "4", "id": 7}) == PromptCompletion("2+2=", "4")
    assert FORMATS["conversational"]({"messages": [U("hi"), A("yo")]}) == Conversation([U("hi"), A("yo")])
    assert FORMATS["language_modeling"]({"text": "abc"}) == Text("abc")
    assert FORMATS["preference"]({"prompt": [U("q")], "chosen": [A("a")], "rejected": [A("b")]}) == Preference(
        [U("q")], [A("a")], [A("b")]
    )
    assert FORMATS["unpaired_preference"]({"prompt": "q", "completion": "a", "label": 0}) == UnpairedPreference(
        "q", "a", False
    )


def test_implicit_preference_splits_the_shared_prompt():
    conv = FORMATS["implicit_preference"](
        {
            "chosen": [U("sky?"), A("blue"), U("sure?"), A("yes")],
            "rejected": [U("sky?"), A("blue"), U("sure?"), A("no")],
        }
    )
    assert conv == Preference([U("sky?"), A("blue"), U("sure?")], [A("yes")], [A("no")])
    # an identical assistant turn before the divergence belongs to both completions, not the prompt
    conv = FORMATS["implicit_preference"]({"chosen": [U("q"), A("x"), U("a")], "rejected": [U("q"), A("x"), U("b")]})
    assert conv.prompt == [U("q")]
    text = FORMATS["implicit_preference"]({"chosen": "The sky is blue", "rejected": "The sky is black"})
    assert text == Preference("The sky is", " blue", " black")
    assert split_shared_text("Q: a b", "Q: a bc") == ("Q: a", " b", " bc")


def test_hh_transcript_parsing():
    text = "\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: and?\n\nAssistant: bye"
    assert parse_hh_transcript(text, "chosen") == [U("hi there"), A("hello"), U("and?"), A("bye")]
    row = {"chosen": text, "rejected": text.replace("bye", "no")}
    assert FORMATS["hh_rlhf"](row) == Preference([U("hi there"), A("hello"), U("and?")], [A("bye")], [A("no")])


@pytest.mark.parametrize(
    "fmt, row, reason",
    [
        ("prompt_completion", {"prompt": "q"}, "missing field 'completion'"),
        ("prompt_completion", {"prompt": "q", "completion": None}, "field 'completion' is null"),
        ("prompt_completion", {"prompt": "q", "completion": "  "}, "empty completion"),
        ("prompt_completion", {"prompt": "q", "completion": 3}, "must be a string"),
        ("prompt_completion", {"prompt": "q", "completion": [A("a")]}, "use strings for both"),
        ("prompt_completion", {"prompt": [U("q")], "completion": [A("")]}, "empty completion"),
        ("prompt_completion", {"prompt": [U("q")], "completion": [U("a")]}, "must start with an assistant"),
        ("prompt_completion", {"prompt": [U("q"), U("q2")], "completion": [A("a")]}, "roles do not alternate"),
        ("conversational", {"messages": [U("q"), {"role": "bot", "content": "a"}]}, "unknown role 'bot'"),
        ("conversational", {"messages": [U("q"), {"content": "a"}]}, "has no role"),
        ("conversational", {"messages": [A("a"), U("q")]}, "roles do not alternate"),
        (
            "conversational",
            {"messages": [U("q"), {"role": "system", "content": "s"}, A("a")]},
            "system message is only allowed first",
        ),
        ("conversational", {"messages": [U("q")]}, "no assistant message"),
        ("conversational", {"messages": []}, "has no messages"),
        ("conversational", {"messages": [U("q"), {"role": "assistant", "content": ["part"]}]}, "content of type list"),
        ("language_modeling", {"text": ""}, "empty text"),
        ("implicit_preference", {"chosen": "same", "rejected": "same"}, "identical"),
        ("implicit_preference", {"chosen": [U("a"), A("x")], "rejected": [U("b"), A("x")]}, "share no prompt"),
        ("unpaired_preference", {"prompt": "q", "completion": "a", "label": "yes"}, "must be true/false"),
        (
            "hh_rlhf",
            {"chosen": "\n\nHuman: q\n\nHuman: q2\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"},
            "roles do not alternate",
        ),
        (
            "hh_rlhf",
            {"chosen": "preamble\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"},
            "text before the first",
        ),
    ],
)
def test_bad_rows_raise_row_error_with_the_reason(fmt, row, reason):
    with pytest.raises(RowError, match=reason):
        FORMATS[fmt](row)


HH_SAME = "\n\nHuman: q\n\nAssistant: a"


@pytest.mark.parametrize(
    "fmt, row",
    [
        ("preference", {"prompt": "q", "chosen": " a", "rejected": " a"}),
        ("preference", {"prompt": [U("q")], "chosen": [A("a")], "rejected": [A("a")]}),
        (
            "preference",
            {"prompt": [U("q")], "chosen": [A("a"), U("more"), A("b")], "rejected": [A("a"), U("more"), A("b")]},
        ),
        ("implicit_preference", {"chosen": "q a", "rejected": "q a"}),
        ("implicit_preference", {"chosen": "same", "rejected": "same"}),  # no word boundary: still "identical"
        ("implicit_preference", {"chosen": [U("q"), A("a")], "rejected": [U("q"), A("a")]}),
        ("implicit_preference", {"chosen": [U("q"), A("a"), U("q2")], "rejected": [U("q"), A("a"), U("q2")]}),
        ("hh_rlhf", {"chosen": HH_SAME, "rejected": HH_SAME}),
    ],
)
def test_identical_completions_are_one_bad_row_reason_in_every_preference_format(fmt, row):
    with pytest.raises(RowError, match=r"^chosen and rejected are identical$"):
        FORMATS[fmt](row)


def test_completions_that_differ_only_in_a_later_turn_are_a_pair():
    pair = FORMATS["preference"](
        {"prompt": [U("q")], "chosen": [A("a"), U("more"), A("b")], "rejected": [A("a"), U("more"), A("c")]}
    )
    assert pair.chosen[-1] != pair.rejected[-1]


def test_to_chat_wraps_plain_strings():
    assert to_chat(PromptCompletion("q", "a")) == PromptCompletion([U("q")], [A("a")])
    assert to_chat(Text("t")) == Text("t")
    assert to_chat(Preference("q", "a", "b")) == Preference([U("q")], [A("a")], [A("b")])


def test_conversational_rows_may_carry_tools():
    from posttrain.data.formats import parse_conversational

    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert parse_conversational({"messages": messages}).tools is None
    assert parse_conversational({"messages": messages, "tools": [tool]}).tools == [tool]
    assert parse_conversational({"messages": messages, "tools": json.dumps([tool])}).tools == [tool]
    with pytest.raises(RowError, match=r"tools\[0\] must be \{'type': 'function'"):
        parse_conversational({"messages": messages, "tools": [{"name": "calculator"}]})
    with pytest.raises(RowError, match="field 'tools' is a string but not JSON"):
        parse_conversational({"messages": messages, "tools": "[{"})
    with pytest.raises(RowError, match="field 'tools' must be a list of function schemas, got dict"):
        parse_conversational({"messages": messages, "tools": tool})

"""Tokenization and loss masks: completion-only and assistant-only labels, checked against
transformers' own assistant masks on a template with {% generation %} tags."""

from __future__ import annotations

import logging

import pytest

import posttrain.data.tokenize as tokenize_module
from posttrain.data.formats import Conversation, Preference, PromptCompletion, Text
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow, fit_to_length, tokenize_sft
from posttrain.data.validate import RowError
from posttrain.tokenizer import Tokenizer
from tests.data.tiny import CHATML_TEMPLATE, tiny_tokenizer

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    U("What is two plus three?"),
    A("five"),
    U("And the sky?"),
    A("The sky is blue."),
    U("Thanks"),
    A("Hello!"),
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def trained_text(tok, row: TokenizedRow) -> list[str]:
    """The decoded runs of labelled tokens."""
    runs, current = [], []
    for label in row.labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


def test_prompt_completion_conversational(tok):
    row = tokenize_sft(tok, PromptCompletion([U("What is two plus three?")], [A("five")]))
    assert row.input_ids == tok.apply_chat_template(
        [U("What is two plus three?"), A("five")], add_generation_prompt=False
    )
    assert trained_text(tok, row) == ["five<|im_end|>\n"]
    prompt_len = len(tok.apply_chat_template([U("What is two plus three?")], add_generation_prompt=True))
    assert row.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len


def test_prompt_completion_plain_strings_get_eos(tok):
    row = tokenize_sft(tok, PromptCompletion("What is two plus three?", " five"))
    assert row.input_ids[-1] == tok.eos_token_id
    assert trained_text(tok, row) == [" five<|im_end|>"]


def test_text_trains_every_token(tok):
    row = tokenize_sft(tok, Text("The sky is blue."))
    assert row.labels == row.input_ids and row.input_ids[-1] == tok.eos_token_id


def test_completion_only_off_trains_the_prompt_too(tok):
    row = tokenize_sft(tok, PromptCompletion([U("q")], [A("a")]), completion_only=False)
    assert row.labels == row.input_ids


def test_preference_trains_on_the_chosen_answer(tok):
    row = tokenize_sft(tok, Preference([U("sky?")], [A("blue")], [A("green")]))
    assert trained_text(tok, row) == ["blue<|im_end|>\n"]


def test_multi_turn_assistant_only_mask(tok):
    row = tokenize_sft(tok, Conversation(MULTI_TURN))
    assert row.input_ids == tok.apply_chat_template(MULTI_TURN, add_generation_prompt=False)
    assert trained_text(tok, row) == ["five<|im_end|>\n", "The sky is blue.<|im_end|>\n", "Hello!<|im_end|>\n"]


def test_assistant_mask_matches_transformers_generation_tags(tok, tmp_path):
    """transformers' `return_assistant_tokens_mask` (needs {% generation %} in the template) is the oracle."""
    transformers = pytest.importorskip("transformers")
    tagged = CHATML_TEMPLATE.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
        "{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
        "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}",
    )
    ours = Tokenizer(tok.backend, chat_template=tagged, eos_token="<|im_end|>", pad_token="<|im_end|>")
    ours.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in (MULTI_TURN, MULTI_TURN[1:3], MULTI_TURN[1:5]):
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        row = tokenize_sft(ours, Conversation(messages))
        assert row.input_ids == list(out["input_ids"])
        assert [int(label != IGNORE_INDEX) for label in row.labels] == list(out["assistant_masks"])


def test_template_without_the_prefix_property_falls_back_and_warns(tok, caplog, monkeypatch):
    # The generation header has an extra newline that a rendered assistant turn lacks.
    odd = CHATML_TEMPLATE.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n\n' }}")
    odd_tok = Tokenizer(tok.backend, chat_template=odd, eos_token="<|im_end|>")
    monkeypatch.setattr(tokenize_module, "_warned_prefix", False)
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        row = tokenize_sft(odd_tok, PromptCompletion([U("q")], [A("five")]))
    assert "not a prefix" in caplog.text
    assert "five<|im_end|>" in "".join(trained_text(tok, row))  # the mask starts where they diverge


def test_fit_to_length():
    row = TokenizedRow(list(range(10)), [IGNORE_INDEX] * 5 + list(range(5, 10)))
    assert fit_to_length(row, 10, "skip") is row
    with pytest.raises(RowError, match="too long: 10 tokens > max_length 8"):
        fit_to_length(row, 8, "skip")
    assert fit_to_length(row, 8, "truncate").input_ids == list(range(8))
    with pytest.raises(RowError, match="no completion tokens within max_length 5"):
        fit_to_length(row, 5, "truncate")

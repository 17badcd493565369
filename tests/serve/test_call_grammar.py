"""The forced-call grammar against the hermes parser: every call text json.dumps can write is accepted at every
prefix, every prefix's closer ends in a text that parses into calls, and text outside the grammar is refused."""

from __future__ import annotations

import json
import random

import pytest

from posttrain.envs.tool_calls import parse_hermes
from posttrain.serve.call_grammar import CallGrammar

NAMES = ["calculator", "lookup", "look"]


def random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8)
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t\u00e9\u4e2d\x01}{][:,') for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def call_text(rng: random.Random, name: str, arguments: dict) -> str:
    separators = rng.choice([(", ", ": "), (",", ":"), (",\n  ", " : ")])
    body = json.dumps(arguments, separators=separators, ensure_ascii=rng.random() < 0.5)
    space = rng.choice(["", " ", "\n"])
    return f'<tool_call>\n{{"name": "{name}", "arguments": {body}{space}}}\n</tool_call>'


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_is_accepted_and_closes_into_calls(seed: int) -> None:
    rng = random.Random(seed)
    grammar = CallGrammar(NAMES, parallel=True)
    for _ in range(15):
        calls = [
            (rng.choice(NAMES), {"a": random_value(rng), "b": random_value(rng)}) for _ in range(rng.randint(1, 2))
        ]
        text = "\n".join(call_text(rng, name, arguments) for name, arguments in calls)
        state = grammar.start
        for i, char in enumerate(text):
            state = grammar.advance(state, char)
            assert state is not None, (text[: i + 1], char)
            if rng.random() < 0.1:  # the shortest end from here is a text of whole calls
                ended = text[: i + 1] + grammar.closer(state)
                assert grammar.accepts(grammar.advance(grammar.start, ended)), ended
                turn = parse_hermes(ended)
                assert not turn.errors and turn.tool_calls, ended
        assert grammar.accepts(state) and grammar.closer(state) == ""
        turn = parse_hermes(text)
        assert [(c.name, c.arguments) for c in turn.tool_calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "other", ',  # not among the names
        '<tool_call>\n{"name": "look", "arguments": [',  # arguments must be an object
        '<tool_call>\n{"name": "look", "arguments": {"a": 01',  # no leading zeros
        '<tool_call>\n{"name": "look", "arguments": {"a": tru}',
        '<tool_call>\n{"name": "look", "arguments": {"a": "\x01',  # raw control character
        '<tool_call>\n{"name": "look", "arguments": {"a": "\\x',  # bad escape
        '<tool_call>\n{"name": "look", "arguments": {"a": "\\ud83d',  # surrogate escapes
        '<tool_call>\n{"name": "look", "arguments": {"a" 1',
        '<tool_call>\n{"name": "look", "arguments": {"a": 1,}',
        '<tool_call>\n{"name": "look", "arguments": {"a": [1,]',
        '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call> more text',
    ],
)
def test_text_outside_the_grammar_is_refused(text: str) -> None:
    assert CallGrammar(NAMES, parallel=True).advance(CallGrammar(NAMES, True).start, text) is None


def test_one_call_only_without_parallel() -> None:
    one = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
    single = CallGrammar(NAMES, parallel=False)
    assert single.accepts(single.advance(single.start, one))
    assert single.advance(single.start, one + "\n") is None
    several = CallGrammar(NAMES, parallel=True)
    assert several.advance(several.start, one + "\n<") is not None


def test_forced_prefix() -> None:
    assert CallGrammar(NAMES, True).forced_prefix() == '<tool_call>\n{"name": "'
    assert CallGrammar(["lookup"], True).forced_prefix() == '<tool_call>\n{"name": "lookup", "arguments": '

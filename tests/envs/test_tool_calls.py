"""The hermes tool-call parser (valid, several, malformed, left open) and the parser registry."""

from __future__ import annotations

import pytest

from posttrain.envs.tool_calls import TOOL_CALL_PARSERS, get_tool_call_parser, parse_hermes, register_tool_call_parser
from posttrain.envs.turns import ParsedTurn, ToolCall
from posttrain.errors import PosttrainError


def test_one_call():
    text = 'I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>'
    turn = parse_hermes(text)
    assert turn.text == text and turn.content == "I will compute."
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "347 * 29"}, "call_0")]
    assert turn.errors == []
    assert turn.as_message() == {
        "role": "assistant",
        "content": "I will compute.",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "347 * 29"}},
            }
        ],
    }


def test_several_calls_ids_from_the_first_index():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
        '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    )
    turn = parse_hermes(text, first_call_index=4)
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [("call_4", "a", {}), ("call_5", "b", {"x": 1})]
    assert turn.content == "and"


def test_no_calls():
    turn = parse_hermes("The answer is 10063.")
    assert turn.tool_calls == [] and turn.errors == [] and turn.content == "The answer is 10063."
    assert turn.as_message() == {"role": "assistant", "content": "The answer is 10063."}


def test_a_call_left_open_at_the_end():
    """Generation that stops on </tool_call> (a stop string) leaves the last call open."""
    turn = parse_hermes('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n')
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "1+1"}, "call_0")] and turn.content == ""


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "tool call 1: invalid JSON"),
        ('{"arguments": {"x": 1}}', "tool call 1: no 'name' string"),
        ('{"name": "", "arguments": {}}', "tool call 1: no 'name' string"),
        ('{"name": "f", "arguments": [1, 2]}', "tool call 1: 'arguments' of 'f' must be a JSON object, got list"),
        ('{"name": "f", "arguments": "not json"}', "tool call 1: 'arguments' of 'f' is a string but not JSON"),
        ('["f"]', "tool call 1: expected a JSON object with 'name' and 'arguments', got list"),
    ],
)
def test_malformed_calls_are_errors_not_calls(body, error):
    turn = parse_hermes(f"<tool_call>\n{body}\n</tool_call>")
    assert turn.tool_calls == []
    assert len(turn.errors) == 1 and turn.errors[0].startswith(error) and "\n" not in turn.errors[0]


def test_a_bad_call_beside_a_good_one():
    text = '<tool_call>{bad}</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    turn = parse_hermes(text, first_call_index=2)
    assert [c.id for c in turn.tool_calls] == ["call_2"]  # ids count the parsed calls only
    assert turn.errors[0].startswith("tool call 1: invalid JSON")


def test_registry_by_name_module_and_file(tmp_path):
    assert get_tool_call_parser() is parse_hermes
    assert get_tool_call_parser("posttrain.envs.tool_calls:parse_hermes") is parse_hermes
    path = tmp_path / "my_parser.py"
    path.write_text(
        "from posttrain.envs.turns import ParsedTurn\n"
        "def parse(text, first_call_index=0):\n    return ParsedTurn(text=text, content=text.upper())\n"
    )
    assert get_tool_call_parser(f"{path}:parse")("hi").content == "HI"

    def mine(text: str, first_call_index: int = 0) -> ParsedTurn:
        return ParsedTurn(text=text, content="")

    register_tool_call_parser("mine", mine)
    try:
        assert get_tool_call_parser("mine") is mine
    finally:
        TOOL_CALL_PARSERS.pop("mine")
    with pytest.raises(PosttrainError, match=r"unknown tool-call parser 'qwen9' \(choose from hermes"):
        get_tool_call_parser("qwen9")
    with pytest.raises(PosttrainError, match=r"tool-call parser '.*missing.py:parse': file .* not found"):
        get_tool_call_parser(f"{tmp_path}/missing.py:parse")
    with pytest.raises(PosttrainError, match="has no 'nothing'"):
        get_tool_call_parser(f"{path}:nothing")

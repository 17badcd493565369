"""The `chatml_tools` template: rendered by our tokenizer exactly as transformers renders it (the oracle), on
conversations with tools, assistant tool calls and tool results; and selectable by name where a model loads."""

from __future__ import annotations

import pytest

from posttrain.chat_templates import CHAT_TEMPLATES, load_chat_template
from posttrain.envs.builtin_tools import calculator
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.tools import as_tool
from posttrain.errors import ConfigError
from tests.data.tiny import tiny_tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE = load_chat_template("chatml_tools")


def lookup(city: str, unit: str = "celsius") -> str:
    """Look up the weather in a city.

    Args:
        city: The city's name.
        unit: "celsius" or "fahrenheit".
    """
    return f"22 degrees {unit} in {city}"


CALL = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 29"}}}
CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is 347 times 29?"}],
    "system and user": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 347 times 29?"},
    ],
    "a full episode": [
        {"role": "user", "content": "What is 347 times 29?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "10063"},
        {"role": "assistant", "content": "The answer is 10063."},
    ],
    "text, two calls, two results in one turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and 2+2?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": {"city": "Paris"}}},
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": "22 degrees celsius in Paris"},
        {"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": "4"},
        {"role": "user", "content": "Thanks, and ünïcode?"},
    ],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, transformers') over the same tokenizer files with the chatml_tools template."""
    ours = tiny_tokenizer()
    ours.chat_template = TEMPLATE
    directory = tmp_path_factory.mktemp("tok")
    ours.save(directory)
    return ours, transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_matches_transformers(pair, name, with_tools, add_generation_prompt):
    ours, theirs = pair
    messages = CONVERSATIONS[name]
    functions = [calculator, lookup]
    schemas = [as_tool(fn).schema for fn in functions] if with_tools else None
    expected = theirs.apply_chat_template(
        messages, tools=functions if with_tools else None, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    text = ours.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    expected_ids = theirs.apply_chat_template(
        messages,
        tools=functions if with_tools else None,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
    )
    assert (
        ours.apply_chat_template(messages, tools=schemas, add_generation_prompt=add_generation_prompt) == expected_ids
    )


def test_what_the_model_sees():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    text = tokenizer.apply_chat_template(
        CONVERSATIONS["a full episode"], tools=[as_tool(calculator).schema], add_generation_prompt=False, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert "<|im_start|>user\n<tool_response>\n10063\n</tool_response><|im_end|>\n" in text
    # no tools: no tool section, the plain ChatML turns
    plain = tokenizer.apply_chat_template(CONVERSATIONS["user only"], tokenize=False)
    assert "<tools>" not in plain and plain.endswith(
        "<|im_start|>user\nWhat is 347 times 29?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_rendered_call_parses_back():
    """What the template writes for an assistant's calls is what the hermes parser reads (the round trip the
    rollout relies on): the text after the generation prompt parses to the same calls."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    messages = CONVERSATIONS["text, two calls, two results in one turn"]
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    full = tokenizer.apply_chat_template(messages[:3], add_generation_prompt=False, tokenize=False)
    assert full.startswith(prompt)
    turn = parse_hermes(full[len(prompt) :].removesuffix("<|im_end|>\n"))
    assert turn.content == "Let me check."
    assert [(call.name, call.arguments) for call in turn.tool_calls] == [
        ("lookup", {"city": "Paris"}),
        ("calculator", {"expression": "2+2"}),
    ]
    assert turn.errors == []


def test_prefix_preserving_across_tool_turns():
    """Rendering a conversation, then the same with a tool result appended, only adds text at the end."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    messages = CONVERSATIONS["a full episode"]
    shorter = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    longer = tokenizer.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False)
    assert longer.startswith(shorter)


def test_spec_is_a_name_or_a_path(tmp_path):
    assert load_chat_template("chatml_tools") == CHAT_TEMPLATES["chatml_tools"].read_text()
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match=r"model.chat_template: 'chatml_tool' is neither a built-in template"):
        load_chat_template("chatml_tool", key="model.chat_template")


def test_model_section_checks_the_name_before_loading():
    from posttrain.trainers.sections import ModelSection

    ModelSection(chat_template="chatml_tools").validate()
    with pytest.raises(ConfigError, match="model.chat_template"):
        ModelSection(chat_template="nope").validate()


def test_load_model_replaces_the_template(tmp_path):
    from posttrain.models.checkpoint_io import save_hf_dir
    from posttrain.models.hub import load_model
    from tests.data.tiny import tiny_model

    save_hf_dir(tiny_model(), tmp_path, tokenizer=tiny_tokenizer())
    _, tokenizer = load_model(tmp_path, device="cpu", chat_template="chatml_tools")
    assert tokenizer.chat_template == TEMPLATE
    _, original = load_model(tmp_path, device="cpu")
    assert original.chat_template != TEMPLATE

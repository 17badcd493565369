"""Tool calls on /v1/chat/completions through the openai client, over a tiny model served with the chatml_tools
template whose sampler is scripted (each reply is a given text, then EOS): tools and earlier calls rendered into
the prompt the engine receives, one and two calls parsed, a malformed call kept as content, a stream's deltas
reassembling to the same reply, tool_choice, return_token_ids, and the 400s. (Forced calls over free sampling:
test_tool_choice.py.)"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from posttrain.chat_templates import load_chat_template
from posttrain.cli import main
from posttrain.engine import EngineConfig
from posttrain.serve.tools import ToolCallReader, tool_calling
from posttrain.tokenizer import Tokenizer
from tests.serve.conftest import BASE, LiveServer, running, tiny_model

MODEL = "tiny-tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
ASK = [{"role": "user", "content": "What is 347 times 29?"}]


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


ONE_CALL = "I will compute it.\n" + call_text("calculator", {"expression": "347 * 29"})
TWO_CALLS = call_text("calculator", {"expression": "1 + 1"}) + "\n" + call_text("weather", {"city": "Paris"})
MALFORMED = '<tool_call>\n{"name": "calculator", "arguments": {oops}}\n</tool_call>'


class Script:
    """What the model writes: every sample emits the ids of `text`, then EOS. Records the prompts it is given."""

    def __init__(self, tokenizer: Tokenizer, engine: object) -> None:
        self.tokenizer = tokenizer
        self.eos = min(engine.eos_token_ids)
        self.ids: list[int] = []
        self.prompts: list[list[int]] = []
        sample, add_request = engine.runner.sample, engine.add_request

        def scripted_sample(logits, groups, eos_token_ids):
            drawn = sample(logits, groups, eos_token_ids)
            seqs = [seq for group in groups for seq in group]
            forced = [self.next_id(len(seq.output_token_ids)) for seq in seqs]
            return dataclasses.replace(drawn, token_ids=torch.tensor(forced, device=drawn.token_ids.device))

        def recording_add_request(request_id, prompt_token_ids, *args, **kwargs):
            self.prompts.append(list(prompt_token_ids))
            return add_request(request_id, prompt_token_ids, *args, **kwargs)

        engine.runner.sample = scripted_sample
        engine.add_request = recording_add_request

    def next_id(self, done: int) -> int:
        return self.ids[done] if done < len(self.ids) else self.eos

    def says(self, text: str) -> list[int]:
        """Script the next replies; returns the completion's ids as the engine will report them."""
        self.ids = self.tokenizer.encode(text)
        return self.ids + [self.eos]


@pytest.fixture(scope="module")
def tools_server(default_model_dir: Path) -> Iterator[tuple[str, Script, Tokenizer]]:
    from posttrain.serve.app import build_app
    from posttrain.serve.loading import build_served_models

    tokenizer = Tokenizer.from_dir(default_model_dir)
    tokenizer.chat_template = load_chat_template("chatml_tools")
    # one step at a time: the script forces each token through runner.sample, which chained decode steps draw past
    config = EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=512, decode_steps=1)
    async_engine = build_served_models(tiny_model(tokenizer), tokenizer, MODEL, None, config)
    script = Script(tokenizer, async_engine.models[MODEL].engine)
    with running(build_app(async_engine, tokenizer, tool_calling=tool_calling("hermes"))) as base_url:
        yield base_url + "/v1", script, tokenizer


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server[0], api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def script(tools_server) -> Script:
    return tools_server[1]


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL, max_tokens=80, **kwargs)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str, dict, str, list, list[int], list[int] | None]:
    """A stream reassembled: content, calls by index, the last finish_reason, every content delta, the
    completion's token ids, the prompt's token ids (first chunk)."""
    content, calls, finish, pieces, token_ids = "", {}, None, [], []
    chunks = list(chat(client, stream=True, extra_body={"return_token_ids": True}, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                pieces.append(delta.content)
                content += delta.content
            for call in delta.tool_calls or []:
                assert call.id.startswith("call_") and call.type == "function"
                calls[call.index] = (call.function.name, json.loads(call.function.arguments))
            token_ids += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
    return content, calls, finish, pieces, token_ids, chunks[0].model_extra.get("prompt_token_ids")


def test_tools_and_earlier_calls_reach_the_prompt(client: openai.OpenAI, script: Script, tools_server) -> None:
    tokenizer = tools_server[2]
    ids = script.says("It is 10063.")
    conversation = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "347 * 29"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "10063"},
    ]
    got = chat(client, messages=conversation, tools=TOOLS, temperature=0, extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.message.content == "It is 10063." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == ids
    # the template got the tools and the call's arguments as an object (as HF templates expect)
    conversation[1]["tool_calls"][0]["function"]["arguments"] = {"expression": "347 * 29"}
    conversation[1]["content"] = ""
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tools=TOOLS)
    assert got.model_extra["prompt_token_ids"] == script.prompts[-1] == expected
    prompt = tokenizer.decode(expected)
    assert json.dumps(TOOLS[0]) in prompt and "<tool_response>\n10063\n</tool_response>" in prompt
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>' in prompt


def test_one_and_two_calls_stream_and_not(client: openai.OpenAI, script: Script) -> None:
    script.says(ONE_CALL)
    one = chat(client, messages=ASK, tools=TOOLS)
    assert one.choices[0].message.content == "I will compute it."
    assert calls_of(one.choices[0].message) == [("calculator", {"expression": "347 * 29"})]
    assert one.choices[0].message.tool_calls[0].id.startswith("call_")
    assert one.choices[0].finish_reason == "tool_calls"
    content, calls, finish, pieces, _, _ = streamed(client, messages=ASK, tools=TOOLS)
    assert content == "I will compute it." and finish == "tool_calls"
    assert calls == {0: ("calculator", {"expression": "347 * 29"})}
    assert not any("<" in piece or "{" in piece for piece in pieces)  # no markup, partial or whole
    # the reply sent back as the client library dumps it, with the tool's answer: the next prompt renders both
    call = one.choices[0].message.tool_calls[0]
    answer = {"role": "tool", "tool_call_id": call.id, "content": "10063"}
    script.says("10063.")
    chat(client, messages=ASK + [one.choices[0].message.model_dump(exclude_none=True), answer], tools=TOOLS)
    prompt = script.tokenizer.decode(script.prompts[-1])
    assert "I will compute it.\n" + call_text("calculator", {"expression": "347 * 29"}) in prompt
    assert "<tool_response>\n10063\n</tool_response>" in prompt

    script.says(TWO_CALLS)  # a tool the request does not list is still returned: the client decides
    two = chat(client, messages=ASK, tools=TOOLS, tool_choice="auto")
    message = two.choices[0].message
    assert message.content is None and two.choices[0].finish_reason == "tool_calls"
    assert calls_of(message) == [("calculator", {"expression": "1 + 1"}), ("weather", {"city": "Paris"})]
    assert len({c.id for c in message.tool_calls}) == 2
    content, calls, finish, pieces, _, _ = streamed(client, messages=ASK, tools=TOOLS)
    assert (content, finish, pieces) == ("", "tool_calls", [])
    assert [calls[i] for i in sorted(calls)] == calls_of(message)


def test_malformed_call_is_content(client: openai.OpenAI, script: Script) -> None:
    script.says(MALFORMED)
    got = chat(client, messages=ASK, tools=TOOLS)
    assert got.choices[0].message.content == MALFORMED and got.choices[0].message.tool_calls is None
    assert got.choices[0].finish_reason == "stop"
    content, calls, finish, _, _, _ = streamed(client, messages=ASK, tools=TOOLS)
    assert (content, calls, finish) == (MALFORMED, {}, "stop")


def test_tool_choice_none_and_named(client: openai.OpenAI, script: Script) -> None:
    script.says(ONE_CALL)
    plain = chat(client, messages=ASK, tools=TOOLS, tool_choice="none")
    assert plain.choices[0].message.content == ONE_CALL and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    content, calls, finish, _, _, _ = streamed(client, messages=ASK, tools=TOOLS, tool_choice="none")
    assert (content, calls, finish) == (ONE_CALL, {}, "stop")
    named = {"type": "function", "function": {"name": "calculator"}}
    # the reply is pre-filled up to the arguments (prompt side); the model writes them and the close
    ids = script.says('{"expression": "347 * 29"}}\n</tool_call>')
    forced = chat(client, messages=ASK, tools=TOOLS, tool_choice=named, extra_body={"return_token_ids": True})
    assert calls_of(forced.choices[0].message) == [("calculator", {"expression": "347 * 29"})]
    assert forced.choices[0].finish_reason == "stop"  # as OpenAI's for a named function
    assert forced.choices[0].model_extra["token_ids"] == ids
    prefill = '<tool_call>\n{"name": "calculator", "arguments": '
    assert script.tokenizer.decode(script.prompts[-1]).endswith("<|im_start|>assistant\n" + prefill)


def test_return_token_ids_stream_equals_engine(client: openai.OpenAI, script: Script) -> None:
    ids = script.says(ONE_CALL)
    whole = chat(client, messages=ASK, tools=TOOLS, extra_body={"return_token_ids": True})
    assert whole.choices[0].model_extra["token_ids"] == ids
    assert whole.model_extra["prompt_token_ids"] == script.prompts[-1]
    _, _, _, _, token_ids, prompt_ids = streamed(client, messages=ASK, tools=TOOLS)
    assert token_ids == ids and prompt_ids == script.prompts[-1]
    plain = chat(client, messages=ASK, tools=TOOLS)
    assert plain.choices[0].model_extra.get("token_ids") is None and plain.model_extra.get("prompt_token_ids") is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.[0].function.name"),
        (
            {
                "messages": ASK
                + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}]
            },
            "messages.[1].tool_calls.[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_400(tools_server, body: dict, param: str) -> None:
    reply = httpx.post(tools_server[0] + "/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def test_template_without_tools_is_400(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, max_tokens=4)
    assert error.value.param == "tools" and "--chat-template chatml_tools" in error.value.message


@pytest.mark.parametrize("text", [ONE_CALL, TWO_CALLS, MALFORMED, "no call <tool", "a < b\n\n", ONE_CALL + "\n\nDone."])
def test_reader_streamed_equals_whole(text: str) -> None:
    whole_content, whole_calls = ToolCallReader(tool_calling("hermes")).update(text, finished=True)
    reader = ToolCallReader(tool_calling("hermes"))
    pieces, calls = [], []
    for i, char in enumerate(text):
        content, deltas = reader.feed(char, finished=i == len(text) - 1)
        pieces.append(content)
        calls += [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas]
        if whole_calls:
            assert "<" not in content
    assert "".join(pieces) == whole_content
    assert calls == [(i, c.name, c.arguments) for i, c in enumerate(whole_calls)]


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--tool-call-parser", "nope"], "error: --tool-call-parser: unknown tool-call parser 'nope'"),
        (["--chat-template", "nope"], "error: --chat-template: 'nope' is neither a built-in template"),
    ],
)
def test_bad_serve_flags_are_one_line(flag: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", "--model", "/no/such/model", *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message)

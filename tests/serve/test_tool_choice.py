"""tool_choice "required" and a named function enforced, and parallel_tool_calls false, over the tiny random
model (whose free text is never a call, so every call it returns is the grammar's doing): each reply parses
into calls to listed tools, streamed and not; the prefill is prompt-side; the 400s name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from posttrain.chat_templates import load_chat_template
from posttrain.engine import EngineConfig
from posttrain.serve.tools import tool_calling
from posttrain.tokenizer import Tokenizer
from tests.serve.conftest import running, tiny_model
from tests.serve.test_tools import ASK, TOOLS

MODEL = "tiny-forced"
NAMES = {tool["function"]["name"] for tool in TOOLS}


@pytest.fixture(scope="module")
def forced_server(default_model_dir: Path) -> Iterator[tuple[str, Tokenizer]]:
    from posttrain.serve.app import build_app
    from posttrain.serve.loading import build_served_models

    tokenizer = Tokenizer.from_dir(default_model_dir)
    tokenizer.chat_template = load_chat_template("chatml_tools")
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=512)
    async_engine = build_served_models(tiny_model(tokenizer), tokenizer, MODEL, None, config)
    with running(build_app(async_engine, tokenizer, tool_calling=tool_calling("hermes"))) as base_url:
        yield base_url + "/v1", tokenizer


@pytest.fixture(scope="module")
def client(forced_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=forced_server[0], api_key="unused", max_retries=0, timeout=120)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.7, 1), (1.0, 2), (1.5, 3)])
def test_required_always_yields_parsed_calls(client: openai.OpenAI, temperature: float, seed: int | None) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        temperature=temperature,
        seed=seed,
        max_tokens=40,
    )
    for choice in reply.choices:
        calls = calls_of(choice.message)
        assert calls and all(name in NAMES for name, _ in calls), choice.message
        assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_named_tool_and_one_call(client: openai.OpenAI, forced_server) -> None:
    tokenizer = forced_server[1]
    named = {"type": "function", "function": {"name": "lookup"}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=40,
        parallel_tool_calls=False,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    prefill = '<tool_call>\n{"name": "lookup", "arguments": '
    prompt_ids = reply.model_extra["prompt_token_ids"]
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n" + prefill)  # prefill: prompt side
    assert reply.usage.prompt_tokens == len(prompt_ids)
    for choice in reply.choices:
        assert [name for name, _ in calls_of(choice.message)] == ["lookup"]
        assert choice.finish_reason == "stop"  # as OpenAI's for a named function
        token_ids = choice.model_extra["token_ids"]  # only what the model sampled, each with its logprob
        assert sum(len(c.model_extra["token_ids"]) for c in reply.choices) >= len(token_ids)
        assert len(token_ids) == len(choice.logprobs.content)
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)


def test_streamed_forced_calls_equal_whole(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kwargs)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                calls[call.index] = (call.function.name, json.loads(call.function.arguments))
            finish = choice.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == calls_of(whole.choices[0].message)


def test_parallel_tool_calls_false_keeps_one(client: openai.OpenAI) -> None:
    several = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4, temperature=1.0, seed=11, max_tokens=60
    )
    one = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=4,
        temperature=1.0,
        seed=11,
        max_tokens=60,
        parallel_tool_calls=False,
    )
    assert all(len(choice.message.tool_calls) == 1 for choice in one.choices)
    assert all(len(choice.message.tool_calls) >= 1 for choice in several.choices)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "always"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
        ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls", "maybe"),
    ],
)
def test_bad_tool_choice_is_400(forced_server, body: dict, param: str, words: str) -> None:
    reply = httpx.post(forced_server[0] + "/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error

"""The server through the official `openai` client: greedy parity with LLM.generate, streaming equals
non-streaming, n / seed / logprobs / stop / usage, and a LoRA adapter served under its own name."""

from __future__ import annotations

import httpx
import openai
import pytest

from posttrain.engine import LLM, SamplingParams
from tests.serve.conftest import BASE, LORA, LiveServer, tiny_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def reference(server: LiveServer, prompts, max_tokens: int, adapter: bool = False) -> list:
    """LLM.generate on an identical but separate module (the server's module switches adapters)."""
    model = tiny_model(server.tokenizer)
    if adapter:
        from posttrain.peft import load_peft_adapter

        load_peft_adapter(model, server.adapter_dir, adapter_name="ref")
    llm = LLM(model, server.tokenizer, num_kv_blocks=128)
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_models_and_health(server: LiveServer, client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, LORA}
    assert cards[LORA].model_extra["parent"] == BASE
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_completions_greedy_equal_llm_generate(server: LiveServer, client: openai.OpenAI) -> None:
    expected = reference(server, PROMPTS, 12)
    got = client.completions.create(model=BASE, prompt=PROMPTS, temperature=0, max_tokens=12)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [e.outputs[0].text for e in expected]
    assert got.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert got.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    # the same through a stream, chunk by chunk
    stream = client.completions.create(
        model=BASE, prompt=PROMPTS[0], temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0].outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected[0].outputs[0].token_ids)


def test_chat_greedy_equal_llm_generate_streaming_and_not(server: LiveServer, client: openai.OpenAI) -> None:
    expected = reference(server, [CHAT], 10)[0].outputs[0]
    got = client.chat.completions.create(model=BASE, messages=CHAT, temperature=0, max_completion_tokens=10)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].finish_reason == ("length" if len(expected.token_ids) == 10 else "stop")
    stream = client.chat.completions.create(
        model=BASE, messages=CHAT, temperature=0, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        got.choices[0].finish_reason
    ]
    assert chunks[-1].usage.prompt_tokens == got.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_lora_model_uses_its_adapter(server: LiveServer, client: openai.OpenAI) -> None:
    with_adapter = reference(server, PROMPTS[:1], 12, adapter=True)[0].outputs[0].text
    base = reference(server, PROMPTS[:1], 12)[0].outputs[0].text
    assert with_adapter != base  # the adapter matters, so the check below means something
    got = client.completions.create(model=LORA, prompt=PROMPTS[0], temperature=0, max_tokens=12)
    assert got.choices[0].text == with_adapter
    assert got.model == LORA
    again = client.completions.create(model=BASE, prompt=PROMPTS[0], temperature=0, max_tokens=12)
    assert again.choices[0].text == base


def test_n_seed_and_logprobs(server: LiveServer, client: openai.OpenAI) -> None:
    kwargs = dict(model=BASE, prompt=PROMPTS[0], n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=6, logprobs=2)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded: reproducible
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
        assert all(x <= 0 for x in lp.token_logprobs) and all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=BASE, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in content)


def test_stop_string_cuts_text_and_never_leaks_in_stream(server: LiveServer, client: openai.OpenAI) -> None:
    full = client.completions.create(model=BASE, prompt=PROMPTS[1], temperature=0, max_tokens=16).choices[0].text
    start = next(i for i in range(len(full) // 2, len(full) - 1) if full[i : i + 2].strip())
    stop = full[start : start + 2]
    cut = full[: full.index(stop)]
    got = client.completions.create(model=BASE, prompt=PROMPTS[1], temperature=0, max_tokens=16, stop=[stop])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=BASE, prompt=PROMPTS[1], temperature=0, max_tokens=16, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut

"""`echo` on /v1/completions, as lm-evaluation-harness's local-completions model scores text: the prompt's
logprobs against a plain forward pass, echo plus generation, text_offset into the echoed text, top_logprobs
against torch.topk, and prompts given as token ids."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.serve.conftest import BASE, LiveServer, tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def dense_log_softmax(server: LiveServer, ids: list[int]) -> torch.Tensor:
    """(P - 1, V): log_softmax of the logits at t - 1, from an identical separate module."""
    with torch.no_grad():
        return torch.log_softmax(tiny_model(server.tokenizer)(torch.tensor([ids]))[0, :-1].float(), dim=-1)


def token_text(server: LiveServer, token_id: int) -> str:
    return server.tokenizer.decode([token_id], skip_special_tokens=False)


def assert_offsets_index_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    for token, offset in zip(tokens, offsets):
        assert text[offset : offset + len(token)] == token


def test_score_prompt_equals_forward_pass(server: LiveServer, client: openai.OpenAI) -> None:
    ids = server.tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = dense_log_softmax(server, ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    got = client.completions.create(model=BASE, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    choice = got.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [token_text(server, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), expected, atol=1e-4)
    assert len(lp.top_logprobs) == len(ids) and all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0
    assert_offsets_index_text(choice.text, lp.tokens, lp.text_offset)


def test_prompt_top_logprobs_match_topk(server: LiveServer, client: openai.OpenAI) -> None:
    ids = server.tokenizer.encode(PROMPT, add_special_tokens=True)
    values, top_ids = dense_log_softmax(server, ids).topk(3, dim=-1)
    got = client.completions.create(model=BASE, prompt=PROMPT, echo=True, max_tokens=0, logprobs=3)
    tops = got.choices[0].logprobs.top_logprobs
    for position, top in enumerate(tops[1:]):
        expected = {token_text(server, int(t)): float(v) for t, v in zip(top_ids[position], values[position])}
        assert set(top) == set(expected)
        assert all(abs(top[k] - expected[k]) < 1e-4 for k in expected)
    # logprobs=0: each token's own logprob, no alternatives (as without echo)
    plain = client.completions.create(model=BASE, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    assert plain.choices[0].logprobs.top_logprobs is None
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(got.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_echo_with_generation(server: LiveServer, client: openai.OpenAI) -> None:
    prompts = [PROMPT, "def fibonacci(n):"]
    plain = client.completions.create(model=BASE, prompt=prompts, temperature=0, max_tokens=4, logprobs=2)
    got = client.completions.create(model=BASE, prompt=prompts, temperature=0, max_tokens=4, logprobs=2, echo=True)
    assert got.usage.completion_tokens == plain.usage.completion_tokens
    for prompt, echoed, generated in zip(prompts, got.choices, plain.choices):
        assert echoed.text == prompt + generated.text and echoed.finish_reason == generated.finish_reason
        P = len(server.tokenizer.encode(prompt, add_special_tokens=True))
        lp, gen = echoed.logprobs, generated.logprobs
        assert (
            len(lp.tokens)
            == len(lp.token_logprobs)
            == len(lp.top_logprobs)
            == len(lp.text_offset)
            == P + len(gen.tokens)
        )
        assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
        assert lp.tokens[P:] == gen.tokens and lp.top_logprobs[P:] == gen.top_logprobs
        assert lp.token_logprobs[P:] == pytest.approx(gen.token_logprobs, abs=1e-4)
        assert lp.text_offset[P:] == [len(prompt) + o for o in gen.text_offset]
        assert_offsets_index_text(echoed.text, lp.tokens[:P], lp.text_offset[:P])
    # echo without logprobs: the text only
    bare = client.completions.create(model=BASE, prompt=PROMPT, temperature=0, max_tokens=4, echo=True)
    assert bare.choices[0].text == got.choices[0].text and bare.choices[0].logprobs is None


def test_token_id_prompt_is_decoded(server: LiveServer, client: openai.OpenAI) -> None:
    ids = server.tokenizer.encode(PROMPT, add_special_tokens=True)
    by_text = client.completions.create(model=BASE, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    by_ids = client.completions.create(model=BASE, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert by_ids.choices[0].text == server.tokenizer.decode(ids, skip_special_tokens=False)
    assert by_ids.choices[0].logprobs.tokens == by_text.choices[0].logprobs.tokens
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(
        by_text.choices[0].logprobs.token_logprobs, abs=1e-4
    )

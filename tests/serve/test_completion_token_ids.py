"""return_token_ids on /v1/completions against the engine itself: the prompt ids are the engine's tokenization,
the completion ids and each sampled token's logprob (OpenAI's completions logprobs lists) are what an LLM over
the same weights gives for the same request, within the rounding of the engine's compute dtype; streamed
chunks carry the same ids."""

from __future__ import annotations

import openai
import pytest
import torch

from posttrain.engine import LLM, SamplingParams
from tests.serve.conftest import BASE, LiveServer, tiny_model

PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 7)])
def test_token_ids_and_logprobs_equal_the_engine(
    server: LiveServer, client: openai.OpenAI, temperature: float, seed: int | None
) -> None:
    got = client.completions.create(
        model=BASE,
        prompt=PROMPTS,
        max_tokens=8,
        temperature=temperature,
        seed=seed,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    llm = LLM(tiny_model(server.tokenizer), server.tokenizer, num_kv_blocks=64)
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=8, logprobs=2)
    engine_outputs = llm.generate(PROMPTS, params)
    # logprobs of the same weights in the same dtype: they may differ only by the rounding of a forward pass in
    # another batch shape (a few units in the last place of the logits, carried through log_softmax)
    eps = torch.finfo(llm.engine.compute_dtype).eps
    for choice, prompt, expected in zip(got.choices, PROMPTS, engine_outputs):
        ids = choice.model_extra["prompt_token_ids"]
        assert ids == server.tokenizer.encode(prompt, add_special_tokens=True) == expected.prompt_token_ids
        sample = expected.outputs[0]
        assert choice.model_extra["token_ids"] == sample.token_ids
        lp = choice.logprobs
        assert lp.tokens == [server.tokenizer.decode([t]) for t in sample.token_ids]
        for mine, theirs in zip(lp.token_logprobs, sample.logprobs, strict=True):
            assert abs(mine - theirs) <= 64 * eps * (1 + abs(theirs))
        for mine, theirs in zip(lp.top_logprobs, sample.top_logprobs, strict=True):
            assert len(mine) == 2
            for (token, value), (expected_id, expected_value) in zip(mine.items(), theirs):
                assert token == server.tokenizer.decode([expected_id])
                assert abs(value - expected_value) <= 64 * eps * (1 + abs(expected_value))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_stream_carries_the_same_ids(server: LiveServer, client: openai.OpenAI) -> None:
    kwargs = dict(model=BASE, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs).choices[0]
    prompt_ids, token_ids = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            prompt_ids.append(choice.model_extra.get("prompt_token_ids"))
            token_ids += choice.model_extra.get("token_ids") or []
    assert prompt_ids[0] == whole.model_extra["prompt_token_ids"] and not any(prompt_ids[1:])
    assert token_ids == whole.model_extra["token_ids"]
    plain = client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=2).choices[0]
    assert plain.model_extra.get("token_ids") is None and plain.model_extra.get("prompt_token_ids") is None

"""vLLM's `prompt_logprobs` extension on /v1/completions and /v1/chat/completions: per prompt token (None for
the first) the token's own logprob and rank and the k most likely tokens, keyed by token id, against a plain
forward pass; alongside echo; refused in a stream and out of range."""

from __future__ import annotations

import openai
import pytest

from tests.serve.conftest import BASE, LiveServer
from tests.serve.test_echo import PROMPT, dense_log_softmax, token_text


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def assert_vllm_prompt_logprobs(server: LiveServer, ids: list[int], entries: list, k: int) -> None:
    dense = dense_log_softmax(server, ids)  # (P - 1, V)
    assert len(entries) == len(ids) and entries[0] is None
    values, top_ids = dense.topk(k, dim=-1) if k else (None, None)
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
        mine = entry[str(token)]
        assert abs(mine["logprob"] - dense[position, token].item()) < 1e-4
        assert mine["rank"] == int((dense[position] > dense[position, token]).sum()) + 1
        assert mine["decoded_token"] == token_text(server, token)
        expected_ids = {str(int(t)) for t in top_ids[position]} if k else set()
        assert set(entry) == expected_ids | {str(token)}  # k entries, or k + 1 when the token is not among them
        for place, (t, v) in enumerate(zip(top_ids[position].tolist(), values[position].tolist()) if k else [], 1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4
            if t != token:
                assert entry[str(t)]["rank"] == place


@pytest.mark.parametrize("k", [0, 3])
def test_completions_prompt_logprobs_match_a_forward_pass(server: LiveServer, client: openai.OpenAI, k: int) -> None:
    ids = server.tokenizer.encode(PROMPT, add_special_tokens=True)
    got = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": k})
    for choice in got.choices:
        assert_vllm_prompt_logprobs(server, ids, choice.model_extra["prompt_logprobs"], k)
        assert choice.logprobs is None  # the sample's logprobs were not asked for


def test_prompt_logprobs_with_echo_keep_each_their_own_k(server: LiveServer, client: openai.OpenAI) -> None:
    ids = server.tokenizer.encode(PROMPT, add_special_tokens=True)
    got = client.completions.create(
        model=BASE, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1, extra_body={"prompt_logprobs": 4}
    )
    choice = got.choices[0]
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])  # echo's k = logprobs = 1
    assert_vllm_prompt_logprobs(server, ids, choice.model_extra["prompt_logprobs"], 4)


def test_chat_prompt_logprobs_cover_the_templated_prompt(server: LiveServer, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a prime."}]
    ids = list(server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    got = client.chat.completions.create(model=BASE, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 2})
    assert_vllm_prompt_logprobs(server, ids, got.model_extra["prompt_logprobs"], 2)


def test_without_prompt_logprobs_the_field_is_null(client: openai.OpenAI) -> None:
    got = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=1)
    assert got.choices[0].model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs is not supported with stream=true"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_bad_prompt_logprobs_are_refused(client: openai.OpenAI, body: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=BASE,
            prompt=PROMPT,
            max_tokens=1,
            **{k: v for k, v in body.items() if k == "stream"},
            extra_body={k: v for k, v in body.items() if k != "stream"},
        )
    assert message in str(error.value)
    assert error.value.body["param"] == "prompt_logprobs"

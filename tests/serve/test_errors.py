"""Bad requests get OpenAI-shaped 400 / 404 / 413 errors naming the parameter, and the server stays healthy."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import BASE, MAX_MODEL_LEN, LiveServer

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def assert_openai_error(body: dict, param: str | None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


CHAT_CASES = {
    "temperature above 2": (dict(temperature=2.5), "temperature"),
    "temperature below 0": (dict(temperature=-0.1), "temperature"),
    "top_p zero": (dict(top_p=0), "top_p"),
    "top_p above 1": (dict(top_p=1.5), "top_p"),
    "n zero": (dict(n=0), "n"),
    "negative max_tokens": (dict(max_tokens=-1), "max_tokens"),
    "negative max_completion_tokens": (dict(max_completion_tokens=-5), "max_completion_tokens"),
    "top_logprobs too many": (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    "top_logprobs without logprobs": (dict(top_logprobs=2), "top_logprobs"),
    "presence_penalty out of range": (dict(presence_penalty=3), "presence_penalty"),
    "empty stop string": (dict(stop=[""]), "stop"),
    "empty messages": (dict(messages=[]), "messages"),
    "unknown role": (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.[0].role"),
    "context length": (dict(max_tokens=MAX_MODEL_LEN), "messages"),
    "content of the wrong type": (dict(messages=[{"role": "user", "content": 123}]), "messages.[0].content"),
    "image content part": (
        dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages.[0].content.[0].type",
    ),
}


@pytest.mark.parametrize("case", CHAT_CASES, ids=list(CHAT_CASES))
def test_bad_chat_request_is_400(client: openai.OpenAI, case: str) -> None:
    fields, param = CHAT_CASES[case]
    kwargs = {"model": BASE, "messages": MESSAGES, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.status_code == 400
    assert_openai_error(info.value.response.json(), param)


def test_bad_completion_requests_are_400(client: openai.OpenAI) -> None:
    cases = [
        (dict(prompt="hi", max_tokens=MAX_MODEL_LEN), "prompt", "context_length_exceeded"),
        (dict(prompt="hi", logprobs=21), "logprobs", None),
        (dict(prompt=""), "prompt", None),
        (dict(prompt=[]), "prompt", None),
        (dict(prompt=[10**9]), "prompt", None),  # a token id outside the vocabulary
        (dict(prompt="hi", max_tokens=0), "max_tokens", None),  # allowed only with echo (scoring)
        (dict(prompt="hi", echo=True, stream=True), "echo", None),
        (dict(prompt="hi", echo=True, max_tokens=-1), "max_tokens", None),
    ]
    for fields, param, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=BASE, **fields)
        body = info.value.response.json()
        assert_openai_error(body, param)
        if code:
            assert body["error"]["code"] == code


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    body = info.value.response.json()
    assert_openai_error(body, "model")
    assert body["error"]["code"] == "model_not_found"


def test_raw_bodies_non_json_and_oversized(server: LiveServer) -> None:
    url = server.api + "/chat/completions"
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 50_000):
        response = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert_openai_error(response.json(), None)
    big = b'{"model": "tiny", "messages": [], "pad": "' + b"x" * (100 * 1024) + b'"}'
    response = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert_openai_error(response.json(), None)

    def chunked():  # no content-length: the limit is enforced while reading
        for _ in range(100):
            yield b"x" * 1024

    response = httpx.post(url, content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    response = httpx.get(server.api + "/no-such-route")
    assert response.status_code == 404 and "error" in response.json()


def test_server_healthy_after_bad_requests(server: LiveServer, client: openai.OpenAI) -> None:
    for _ in range(3):
        httpx.post(server.api + "/completions", content=b"garbage")
    assert httpx.get(server.base_url + "/health").status_code == 200
    got = client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3, temperature=0)
    assert got.choices[0].finish_reason in ("stop", "length")
    stats = httpx.get(server.base_url + "/debug/stats").json()
    assert all(m["unfinished_requests"] == 0 for m in stats["models"].values())

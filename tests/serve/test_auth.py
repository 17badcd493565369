"""API keys through the official `openai` client: the right key is served, a wrong or missing key gets 401 in
OpenAI's error shape (streams too), /health stays open, and no key reaches a log line."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from posttrain.engine import EngineConfig
from posttrain.errors import PosttrainError
from posttrain.serve.auth import ENV_VAR, bearer_token, resolve_api_keys
from posttrain.tokenizer import Tokenizer
from tests.serve.conftest import BASE, running, tiny_model

KEYS = ["sk-right-0123456789", "sk-second-key"]
WRONG = "sk-wrong-9876543210"
MESSAGES = [{"role": "user", "content": "Hi"}]
UVICORN_LOGGERS = ("uvicorn", "uvicorn.access", "uvicorn.error", "uvicorn.asgi")


@pytest.fixture(scope="module")
def base_url(default_model_dir: Path) -> Iterator[str]:
    from posttrain.serve.app import build_app
    from posttrain.serve.loading import build_served_models

    tokenizer = Tokenizer.from_dir(default_model_dir)
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    async_engine = build_served_models(tiny_model(tokenizer), tokenizer, BASE, None, config)
    app = build_app(async_engine, tokenizer, api_keys=KEYS)
    # The most uvicorn can say (trace level, access log on, records left to propagate) for the log test;
    # uvicorn's logger levels are global, so they are put back for the other tests' servers.
    levels = {name: logging.getLogger(name).level for name in UVICORN_LOGGERS}
    try:
        with running(app, log_level="trace", access_log=True, log_config=None) as url:
            yield url
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def assert_401(response: httpx.Response, code: str | None) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] == code
    assert error["message"] and not any(key in error["message"] for key in KEYS + [WRONG])


def test_right_key_is_served(base_url: str) -> None:
    for key in KEYS:  # any of the keys
        api = client(base_url, key)
        assert [m.id for m in api.models.list().data] == [BASE]
        reply = api.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1


def test_wrong_key_is_401(base_url: str) -> None:
    for key in (WRONG, KEYS[0][:-1], KEYS[0] + "x", KEYS[0].upper()):  # near misses are wrong too
        with pytest.raises(openai.AuthenticationError) as info:
            client(base_url, key).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3)
        assert_401(info.value.response, "invalid_api_key")


def test_no_key_is_401(base_url: str) -> None:
    body = {"model": BASE, "messages": MESSAGES, "max_tokens": 3}
    assert_401(httpx.post(base_url + "/v1/chat/completions", json=body), None)
    for header in ("Basic " + KEYS[0], "Bearer", KEYS[0]):  # another scheme, or no token
        assert_401(httpx.post(base_url + "/v1/chat/completions", json=body, headers={"Authorization": header}), None)
    # The scheme is case-insensitive (RFC 7235), and the key is checked before the body is read.
    ok = httpx.post(base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"bearer {KEYS[1]}"})
    assert ok.status_code == 200
    assert_401(httpx.post(base_url + "/v1/completions", content=b"{not json"), None)


def test_health_is_open_and_every_other_route_is_not(base_url: str) -> None:
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    for path in ("/v1/models", "/debug/stats", "/v1/no-such-route", "/docs"):  # vLLM protects /v1/models too
        assert_401(httpx.get(base_url + path), None)
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    assert httpx.get(base_url + "/debug/stats", headers=headers).status_code == 200
    assert httpx.get(base_url + "/v1/no-such-route", headers=headers).status_code == 404


def test_streaming_request_with_wrong_key_is_401(base_url: str) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(base_url, WRONG).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3, stream=True)
    assert_401(info.value.response, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        client(base_url, WRONG).completions.create(model=BASE, prompt="Hi", max_tokens=3, stream=True)
    chunks = list(
        client(base_url, KEYS[0]).completions.create(model=BASE, prompt="Hi", max_tokens=3, stream=True, temperature=0)
    )
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_no_key_is_logged(base_url: str) -> None:
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("", *UVICORN_LOGGERS)]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        client(base_url, KEYS[0]).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client(base_url, WRONG).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert any("/v1/chat/completions" in line for line in handler.lines)  # the access log did run
    assert not [line for line in handler.lines if any(key in line for key in KEYS + [WRONG])]


def test_bearer_token() -> None:
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"Authorization", b"  BEARER   abc  ")]) == b"abc"
    assert bearer_token([(b"host", b"x")]) is None
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([(b"authorization", b"Bearer ")]) is None


def test_keys_from_flags_or_the_environment() -> None:
    assert resolve_api_keys([], {}) == []
    assert resolve_api_keys(["a", "b,c", " d , e "], {}) == ["a", "b", "c", "d", "e"]
    assert resolve_api_keys(["a", "a"], {}) == ["a"]
    assert resolve_api_keys([], {ENV_VAR: "x,y"}) == ["x", "y"]
    assert resolve_api_keys(["a"], {ENV_VAR: "x"}) == ["a"]  # the flag wins, as in vLLM


@pytest.mark.parametrize(
    "flags, env, message",
    [
        ([""], {}, "--api-key: key 1 is empty"),
        (["good,,other"], {}, "--api-key: key 2 is empty"),
        (["secret key"], {}, "--api-key: key 1 has a space, control or non-ASCII character at position 7"),
        (["sécret"], {}, "--api-key: key 1 has a space, control or non-ASCII character at position 2"),
        ([], {ENV_VAR: ""}, f"{ENV_VAR} is set but empty"),
        ([], {ENV_VAR: "ok,bad\tkey"}, f"{ENV_VAR}: key 2 has a space, control or non-ASCII character at position 4"),
    ],
)
def test_bad_keys_are_refused_without_showing_them(flags: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(PosttrainError) as info:
        resolve_api_keys(flags, env)
    assert str(info.value).startswith(message)
    assert not any(word in str(info.value) for word in ("secret", "sécret", "good", "other", "bad\tkey"))

"""A client that goes away has its request aborted and its KV blocks freed, streaming or not."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.serve.conftest import BASE, LiveServer


def stats(server: LiveServer) -> dict:
    return httpx.get(server.base_url + "/debug/stats").json()


def wait_until_idle(server: LiveServer, free_blocks: int, aborted: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        now = stats(server)
        model = now["models"][BASE]
        if (
            model["free_kv_blocks"] == free_blocks
            and model["unfinished_requests"] == 0
            and now["aborted_requests"] >= aborted
        ):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not freed: {now} (want {free_blocks} free, {aborted} aborted)")
        time.sleep(0.05)


@pytest.fixture
def before(server: LiveServer) -> dict:
    return stats(server)


def test_streaming_client_disconnect_frees_blocks(server: LiveServer, before: dict) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
    start_free = before["models"][BASE]["free_kv_blocks"]
    stream = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
            if received == 3:
                break
    assert stats(server)["models"][BASE]["free_kv_blocks"] < start_free  # it was holding blocks
    stream.close()
    after = wait_until_idle(server, start_free, before["aborted_requests"] + 1)
    assert after["models"][BASE]["generated_tokens"] - before["models"][BASE]["generated_tokens"] < 900


def test_non_streaming_client_disconnect_frees_blocks(server: LiveServer, before: dict) -> None:
    start_free = before["models"][BASE]["free_kv_blocks"]
    body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.api + "/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    after = wait_until_idle(server, start_free, before["aborted_requests"] + 1)
    assert after["models"][BASE]["generated_tokens"] - before["models"][BASE]["generated_tokens"] < 900

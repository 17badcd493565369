"""`posttrain serve` on the command line: a bad or busy port is one `error:` line and exit 2, before the model
loads and before anything says "serving"; a non-loopback address without a key warns; and a real server
started with a key (from the environment, on port 0) prints its address, serves the key and never shows it."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from posttrain.cli import main
from posttrain.errors import PosttrainError
from posttrain.serve import bind
from posttrain.serve.auth import ENV_VAR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_port_out_of_range_is_one_line_exit_2(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", port]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: --port {port}: must be between 0 and 65535 (0 lets the system pick a free port)\n"


def test_port_in_use_is_one_line_exit_2(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    # The missing model would fail too; that the port is reported shows the socket is bound before loading.
    assert main(["serve", "--port", str(busy_port), "--model", "/no/such/model"]) == 2
    out, err = capsys.readouterr()
    assert "serving" not in out
    assert err.count("\n") == 1 and err.startswith(f"error: cannot listen on 127.0.0.1:{busy_port}: ")
    assert "already in use" in err


def test_port_taken_between_bind_and_listen_is_reported(busy_port: int) -> None:
    # Two SO_REUSEADDR sockets may both bind a port while neither listens; the later to listen fails.
    ours = bind.bind_socket("127.0.0.1", 0)
    try:
        port = bind.bound_port(ours)
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
            other.listen()
            with pytest.raises(PosttrainError, match=rf"^cannot listen on 127\.0\.0\.1:{port}: .*already in use"):
                bind.listen(ours, "127.0.0.1")
    finally:
        ours.close()


def test_unknown_host_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --host 'no-such-host.invalid': cannot resolve the address")


@pytest.mark.parametrize(
    "host, key, warned",
    [
        ("0.0.0.0", None, True),
        ("0.0.0.0", "sk-k", False),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
    ],
)
def test_non_loopback_without_key_warns(
    host: str, key: str | None, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model is missing, so the command ends right after binding: the warning comes before the model loads.
    argv = ["serve", "--host", host, "--port", "0", "--model", "/no/such/model"] + (["--api-key", key] if key else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: /no/such/model")
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == int(warned)
    if warned:
        assert re.match(rf"warning: serving on {host}:\d+ without an API key: .*--api-key or {ENV_VAR}", warnings[0])


def test_served_with_a_key_from_the_environment(default_model_dir: Path) -> None:
    key = "sk-from-the-environment-42"
    env = {**os.environ, ENV_VAR: key, "PYTHONPATH": str(ROOT)}
    argv = [
        sys.executable,
        "-m",
        "posttrain.cli",
        "serve",
        "--model",
        str(default_model_dir),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--served-model-name",
        "m",
        "--max-model-len",
        "128",
        "--num-kv-blocks",
        "16",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        line = proc.stdout.readline() if ready else ""  # the serving line: printed once the socket listens
        match = re.fullmatch(r"serving m on (http://127\.0\.0\.1:(\d+)/v1) \(1 API key\)\n", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert int(match[2]) != 0  # the port the system picked
        reply = openai.OpenAI(base_url=match[1], api_key=key, max_retries=0, timeout=120).completions.create(
            model="m", prompt="Hello", max_tokens=2, temperature=0
        )
        assert reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=match[1], api_key="sk-wrong", max_retries=0, timeout=60).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert key not in line + out + err

"""Serving under concurrent load: N streaming chat clients against `posttrain serve` on loopback.

    .venv/bin/python benchmarks/serve.py                          # starts the server (default model), 32 clients
    .venv/bin/python benchmarks/serve.py --clients 32 --max-tokens 32
    .venv/bin/python benchmarks/serve.py --url http://127.0.0.1:8000 --model smollm2-135m   # a running server

Each client sends one streaming chat request (distinct prompts, temperature 0.7, EOS ignored so every
answer is exactly --max-tokens long) and reads the SSE stream to the end. Reported: generated tokens/s
over the whole run (from the usage chunks), time to first token (first content chunk) p50 / p99, failed
requests, and whether KV blocks leaked (the engine's free-block count and unfinished requests after the
run, from /debug/stats, against before it). The anchor is the offline engine (`LLM.generate`) on the same
prompts and lengths in this process, after the server has stopped (skip with --no-offline); the ratio is
what the HTTP layer, SSE and per-token streaming cost, on a quiet machine only: on an oversubscribed CPU
torch's worker threads spin-wait and the anchor can run several times slower than the server's step thread.
Loopback only; bounded by --timeout.
Prints progress to stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Name three prime numbers.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What does a compiler do?",
    "How many legs has a spider?",
    "Give me a synonym for happy.",
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_client(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    done = False
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"ok": False, "error": chunk["error"]["message"]}
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not done or first is None or tokens != max_tokens:
        return {"ok": False, "error": f"incomplete stream (done={done}, tokens={tokens})"}
    return {"ok": True, "ttft": first, "tokens": tokens}


async def load_test(url: str, model: str, clients: int, max_tokens: int, timeout: float) -> dict:
    limits = httpx.Limits(max_connections=clients + 4)
    # A server that requires a key (POSTTRAIN_API_KEY, which the started server reads too) gets the first one.
    key = os.environ.get("POSTTRAIN_API_KEY", "").split(",")[0].strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, headers=headers) as client:
        before = (await client.get(url + "/debug/stats")).json()["models"][model]
        start = time.perf_counter()
        tasks = [one_client(client, url, model, i, max_tokens) for i in range(clients)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)
        except asyncio.TimeoutError:
            results = [TimeoutError(f"run exceeded --timeout {timeout}s")] * clients
        wall = time.perf_counter() - start
        await asyncio.sleep(0.5)  # let aborts (if any) reach the engine loop
        after = (await client.get(url + "/debug/stats")).json()["models"][model]
    results = [r if isinstance(r, dict) else {"ok": False, "error": repr(r)} for r in results]
    good = [r for r in results if r["ok"]]
    ttfts = [r["ttft"] for r in good]
    errors = sorted({r["error"] for r in results if not r["ok"]})
    return {
        "clients": clients,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(sum(r["tokens"] for r in good) / wall, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3) if ttfts else None,
        "failed_requests": len(results) - len(good),
        "errors": errors[:3],
        "kv_blocks_leaked": before["free_kv_blocks"] - after["free_kv_blocks"],
        "unfinished_after": after["unfinished_requests"],
        "engine_steps": after["steps"] - before["steps"],
    }


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "posttrain",
        "serve",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-num-seqs",
        str(max(args.clients, 1)),
    ]
    log("starting: " + " ".join(command))
    server = subprocess.Popen(command, cwd=ROOT, stdout=sys.stderr)  # stdout carries only the JSON line
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise SystemExit("the server did not become healthy in time")


def offline_tokens_per_s(args: argparse.Namespace) -> float:
    from posttrain.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(args.clients, 1),
    )
    prompts = [prompt(i) for i in range(args.clients)]
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.clients)
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return round(sum(len(o.outputs[0].token_ids) for o in outputs) / wall, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--url", default=None, help="a running server on loopback (default: start one)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for server start, and for the run")
    parser.add_argument("--no-offline", action="store_true", help="skip the LLM.generate anchor")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256:
        raise SystemExit("--clients must be in [1, 256]")
    if args.url is not None and httpx.URL(args.url).host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("--url must be a loopback address")
    server = None
    url = args.url
    if url is None:
        port = free_port()
        server = start_server(args, port)
        url = f"http://127.0.0.1:{port}"
    try:
        log(f"{args.clients} streaming clients x {args.max_tokens} tokens against {url}")
        result = asyncio.run(load_test(url, args.model, args.clients, args.max_tokens, args.timeout))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    result = {"benchmark": "serve", "model": args.model, **result}
    if not args.no_offline:
        log("anchor: LLM.generate on the same prompts")
        result["offline_tokens_per_s"] = offline_tokens_per_s(args)
        result["serve_vs_offline"] = round(result["tokens_per_s"] / result["offline_tokens_per_s"], 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

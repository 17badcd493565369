"""The machine's roofs, measured in the run that quotes fractions of them: memory bandwidth and matmul GFLOP/s.

    .venv/bin/python benchmarks/roofs.py --threads 2          # one JSON line: both roofs on 2 threads

    import roofs
    gbs = roofs.memory_bandwidth_gbs(threads=2)             # GB/s (1e9 bytes) a weight stream reads at
    gflops = roofs.matmul_gflops("bfloat16", threads=2)     # GFLOP/s of a (2048, 2048) @ (2048, 2048) matmul

Batch-1 decode reads every weight once per token and does two FLOPs per weight, so it is bound by how fast memory
streams, not by the matmul units: its roof is the read bandwidth. The probe is what a decode step does to its
weights, a read-only pass over a buffer far larger than the L3 cache (256 MB by default, 32 MB of L3 on the Zen 5
this project measures on) reduced to one number (`torch.sum`, which reads each byte once and writes nothing), so
the bytes counted are exactly the buffer's bytes. A copy would count read plus write and, with write-allocate,
move a third stream the count leaves out; a read-only pass has no such ambiguity. Batched decode and prefill reuse
each weight across many rows and are bound by the matmul rate instead: `matmul_gflops` is that roof, a square
matmul big enough (2048 by default) that the kernel's blocking, not the call overhead, sets the rate.

Both probes set torch's threads to `threads` for the measurement and restore the caller's count after, take the
best of a few timed repeats after one untimed warm-up (the best, as a roof is what the machine can do; the
slower repeats are the neighbours on a shared CPU), and cache nothing: the roof is measured in the same run as
the figures it divides, under the same load.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DTYPES = ("float32", "bfloat16")


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside the block, the caller's count restored after."""
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_seconds(call: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed warm-up call."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth_gbs(threads: int, buffer_mb: int = 256, repeats: int = 5) -> float:
    """GB/s (1e9 bytes per second) of a read-only pass over a `buffer_mb` MiB float32 buffer on `threads` threads."""
    import torch

    if buffer_mb < 1:
        raise ValueError(f"buffer_mb must be >= 1, got {buffer_mb}")
    with torch_threads(threads):
        buffer = torch.ones(buffer_mb * 2**20 // 4, dtype=torch.float32)  # touched, so its pages are mapped
        seconds = best_seconds(lambda: buffer.sum(), repeats)
    return buffer.numel() * buffer.element_size() / seconds / 1e9


def matmul_gflops(dtype: str, threads: int, n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s (2 n^3 FLOPs per call) of an (n, n) @ (n, n) matmul in `dtype` ("float32" | "bfloat16")."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    with torch_threads(threads):
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=generator).to(getattr(torch, dtype))
        b = torch.randn(n, n, generator=generator).to(getattr(torch, dtype))
        seconds = best_seconds(lambda: torch.mm(a, b), repeats)
    return 2.0 * n**3 / seconds / 1e9


def measure(threads: int) -> dict[str, object]:
    """Both roofs on `threads` threads, as the benchmarks' JSON lines carry them."""
    return {
        "threads": threads,
        "bandwidth_gbs": round(memory_bandwidth_gbs(threads), 2),
        "matmul_gflops": {dtype: round(matmul_gflops(dtype, threads), 1) for dtype in DTYPES},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the probes (default: torch's)")
    args = parser.parse_args(argv)
    import torch

    print(json.dumps({"benchmark": "roofs", **measure(args.threads or torch.get_num_threads())}))


if __name__ == "__main__":
    main()

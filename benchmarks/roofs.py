"""The machine's roofs, measured in the same run as the figures they bound: memory bandwidth and matmul GFLOP/s.

    import roofs
    roofs.memory_bandwidth_gbs(threads=2)              # GB/s (1e9 bytes) streaming a buffer far larger than L3
    roofs.matmul_gflops("bfloat16", threads=2)         # GFLOP/s of an n x n x n torch.matmul

Batch-1 decode reads every weight once a token and does ~2 FLOPs per weight: it is bound by how fast memory
streams, so its roof is tokens/s <= bandwidth / bytes a token. The probe is that same access pattern: a sum over a
buffer of `megabytes` (default 512, several times any L3 here), which reads every byte once and writes nothing (a
copy would also write, and count bytes the decode never moves). Batched decode multiplies each weight by many rows:
its roof is the matmul rate of the dtype it computes in. Both are the best of `repeats` after a warm-up, with
torch's threads set to `threads` for the probe and restored after. The VM's speed drifts between minutes, which
is why a benchmark measures these beside its own figures rather than quoting them from elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_seconds(call: Callable[[], object], repeats: int, threads: int) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        call()  # warm-up: first-touch page faults, kernel selection
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(previous)


def memory_bandwidth_gbs(threads: int, megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s reading a `megabytes` fp32 buffer once (a sum: every byte read, nothing written)."""
    if threads < 1 or megabytes < 1 or repeats < 1:
        raise ValueError(f"threads, megabytes and repeats must be >= 1, got {threads}, {megabytes}, {repeats}")
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: buffer.sum(), repeats, threads)
    return round(buffer.numel() * 4 / seconds / 1e9, 2)


def matmul_gflops(dtype: str, threads: int, n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of one n x n by n x n torch.matmul in `dtype` ("float32" or "bfloat16"): 2 n^3 FLOPs a call."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if threads < 1 or n < 1 or repeats < 1:
        raise ValueError(f"threads, n and repeats must be >= 1, got {threads}, {n}, {repeats}")
    a = torch.randn(n, n).to(DTYPES[dtype])
    b = torch.randn(n, n).to(DTYPES[dtype])
    seconds = _best_seconds(lambda: torch.matmul(a, b), repeats, threads)
    return round(2 * n**3 / seconds / 1e9, 2)

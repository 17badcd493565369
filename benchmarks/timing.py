"""What the micro-benchmarks share: the best time of repeated calls after a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], reps: int) -> float:
    """Seconds of the fastest of `reps` calls of fn, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best

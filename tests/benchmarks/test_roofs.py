"""benchmarks/roofs.py on tiny sizes: finite positive rates, torch's threads restored, bad values in one line, and
the arithmetic of a rate (bytes or FLOPs over the best time) checked on a tick clock."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _roofs(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("roofs", ROOT / "benchmarks" / "roofs.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "roofs", module)
    spec.loader.exec_module(module)
    return module


def test_rates_are_positive_and_threads_are_restored(monkeypatch: pytest.MonkeyPatch):
    roofs = _roofs(monkeypatch)
    before = torch.get_num_threads()
    assert 0 < roofs.memory_bandwidth_gbs(threads=1, megabytes=4, repeats=2) < math.inf
    assert 0 < roofs.matmul_gflops("float32", threads=1, n=64, repeats=2) < math.inf
    assert 0 < roofs.matmul_gflops("bfloat16", threads=1, n=64, repeats=2) < math.inf
    assert torch.get_num_threads() == before


def test_rates_are_work_over_the_best_time(monkeypatch: pytest.MonkeyPatch):
    """The timed calls take 1.0, 0.5 and 1.5 ms on a fake clock (the warm-up is not timed): the best, 0.5 ms, sets
    the rate. 8 MiB read in 0.5 ms is 16.78 GB/s; 2 x 64^3 FLOPs in 0.5 ms is 1.05 GFLOP/s."""
    roofs = _roofs(monkeypatch)
    ticks = iter([t / 1000 for t in (0.0, 1.0, 1.0, 1.5, 1.5, 3.0)] * 2)
    monkeypatch.setattr(roofs.time, "perf_counter", lambda: next(ticks))
    assert roofs.memory_bandwidth_gbs(threads=1, megabytes=8, repeats=3) == 16.78
    assert roofs.matmul_gflops("float32", threads=1, n=64, repeats=3) == 1.05


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.matmul_gflops("float16", threads=1), "dtype 'float16'"),
        (lambda r: r.matmul_gflops("float32", threads=0), "threads, n and repeats must be >= 1"),
        (lambda r: r.memory_bandwidth_gbs(threads=1, megabytes=0), "threads, megabytes and repeats must be >= 1"),
    ],
)
def test_bad_values(monkeypatch: pytest.MonkeyPatch, call, message: str):  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        call(_roofs(monkeypatch))

"""benchmarks/roofs.py: the probes return positive finite rates on tiny sizes, leave torch's threads as they
found them, and refuse bad arguments."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import roofs  # noqa: E402


def test_bandwidth_is_positive_and_threads_restored() -> None:
    before = torch.get_num_threads()
    gbs = roofs.memory_bandwidth_gbs(threads=1, buffer_mb=4, repeats=2)
    assert math.isfinite(gbs) and gbs > 0
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("dtype", roofs.DTYPES)
def test_matmul_rate_is_positive_and_threads_restored(dtype: str) -> None:
    before = torch.get_num_threads()
    gflops = roofs.matmul_gflops(dtype, threads=1, n=32, repeats=2)
    assert math.isfinite(gflops) and gflops > 0
    assert torch.get_num_threads() == before


def test_threads_restored_when_the_probe_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), roofs.torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("probe failed")
    assert torch.get_num_threads() == before


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        roofs.matmul_gflops("float16", threads=1, n=8)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        roofs.memory_bandwidth_gbs(threads=0, buffer_mb=1)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        roofs.best_seconds(lambda: None, repeats=0)

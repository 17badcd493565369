"""Shared fixtures. Tests run on CPU in fp32 with 2 threads (the CI machine's cores)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# OpenMP's idle threads sleep instead of spinning (set before torch loads libgomp, which reads it once; the ranks
# and CLI runs the tests launch inherit it). The suite runs on 2 cores, where the pytest process's 2 intra-op
# threads share them with torchrun's ranks, subprocess CLI runs and whatever else the machine runs: a thread
# spinning at the end of each parallel region (libgomp's default) takes the core another thread is waiting for,
# and a tiny model's decode loop, thousands of short parallel regions, then ran 3-30x slower (the same result).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # lets tests import `tests.hf_oracle`
    sys.path.insert(0, str(ROOT))

from tests.engine.kernel_builds import KERNEL_MARCHES, forget_kernels, use_kernels_built_for  # noqa: E402

torch.set_num_threads(2)

# The suite runs in fp32 on every CPU: `model.dtype: auto` would train in bf16 on one with fast bf16 (Zen 4/5,
# Sapphire Rapids), and the oracles and bit-exact checks are fp32's. Tests of the bf16 paths force the features
# themselves; set POSTTRAIN_CPU_FEATURES before pytest to run the whole suite as another CPU would.
os.environ.setdefault("POSTTRAIN_CPU_FEATURES", "avx avx2 fma")

# Trackio reads TRACKIO_DIR once, when it is first imported, and `import trl` imports it: so the store is set
# here, before any test module loads. Otherwise the tests write to the user's own store (HF_HOME/trackio), where
# the runs of an earlier suite stay and are found again under the same project and run names.
if "trackio" not in sys.modules:
    _TRACKIO_DIR = tempfile.mkdtemp(prefix="posttrain-test-trackio-")
    os.environ["TRACKIO_DIR"] = _TRACKIO_DIR
    atexit.register(shutil.rmtree, _TRACKIO_DIR, ignore_errors=True)

# Fixtures that load the embedded default model (SmolLM2-135M): tests that take one are `slow`, as are the
# modules marked so by hand; `make test-fast` leaves out `slow` and `torchrun` (tests/distributed's launches).
DEFAULT_MODEL_FIXTURES = {"default_model_dir"}  # fixturenames holds the closure: the server fixture too


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model, converted once into the cache (GGUF -> HF dir)."""
    from posttrain.models.hub import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(params=KERNEL_MARCHES)
def kernel_march(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test that takes it runs against the native kernels built for each of KERNEL_MARCHES
    (tests/engine/kernel_builds.py): this CPU's own instruction set and AVX2's."""
    use_kernels_built_for(request.param, monkeypatch)
    yield request.param
    forget_kernels()

"""Shared fixtures. Tests run on CPU in fp32 with 2 threads (the CI machine's cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # lets tests import `tests.hf_oracle`
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(2)

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

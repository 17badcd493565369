"""The engine tests' fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.kernel_builds import KERNEL_MARCHES, forget_kernels, use_kernels_built_for


@pytest.fixture(params=KERNEL_MARCHES)
def kernel_march(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test that takes it runs against the kernels built for each of KERNEL_MARCHES."""
    use_kernels_built_for(request.param, monkeypatch)
    yield request.param
    forget_kernels()

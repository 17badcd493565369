"""Every test of a `test_*_parallel.py` module launches ranks under torchrun (tests/distributed/launch.py):
marked `torchrun`, which `make test-fast` leaves out. test_pieces.py holds the in-process unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == HERE and item.path.name.endswith("_parallel.py"):
            item.add_marker(pytest.mark.torchrun)

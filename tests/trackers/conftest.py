"""Every tracker test runs offline, and writes only under temporary directories.

Trackio reads `TRACKIO_DIR` once, when it is first imported, so it is set here, at collection, before any
test of this folder imports it; W&B and MLflow read their settings per run (the `offline` fixture)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

if "trackio" not in sys.modules:
    _TRACKIO_DIR = tempfile.mkdtemp(prefix="posttrain-test-trackio-")
    os.environ["TRACKIO_DIR"] = _TRACKIO_DIR
    atexit.register(shutil.rmtree, _TRACKIO_DIR, ignore_errors=True)


def trackio_dir() -> Path:
    """Where the imported trackio keeps its projects (a temporary one unless trackio was imported earlier)."""
    from trackio.utils import TRACKIO_DIR

    return Path(TRACKIO_DIR)


def offline_env(home: Path, mlflow_uri: str) -> dict[str, str]:
    """W&B offline with its caches under `home`, and MLflow's file store at `mlflow_uri`."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
        # MLflow keeps its file store in maintenance mode and asks for this switch to open one.
        "MLFLOW_TRACKING_URI": mlflow_uri,
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run directory (tmp_path/run) whose trackers all stay on this machine; MLflow's store is in it."""
    run_dir = tmp_path / "run"
    for key, value in offline_env(tmp_path, f"file:{run_dir / 'mlruns'}").items():
        monkeypatch.setenv(key, value)
    run_dir.mkdir()
    return run_dir

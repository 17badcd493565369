"""Every tracker test runs offline, and writes only under temporary directories.

Trackio's store is a temporary one, set by tests/conftest.py before anything imports trackio; W&B and MLflow
read their settings per run (the `offline` fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest


def trackio_dir() -> Path:
    """Where the imported trackio keeps its projects (the suite's temporary store)."""
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

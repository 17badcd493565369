"""Tiny random checkpoints shared by the LoRA tests (written once per session by transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.models.checkpoint_io import load_hf_dir
from tests.hf_oracle import save_hf_model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for family in ("llama", "qwen2", "smollm2"):
        directory = tmp_path_factory.mktemp(f"tiny-{family}")
        save_hf_model(family, directory)
        dirs[family] = directory
    return dirs


@pytest.fixture
def llama(tiny_dirs):
    return load_hf_dir(tiny_dirs["llama"]).eval()

"""Fixtures of the trainer tests: a tiny model directory and the QA rows (test_sft and test_compute_dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.tiny import save_tiny_model_dir, write_qa_jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_qa_jsonl(tmp_path_factory.mktemp("data") / "qa.jsonl")

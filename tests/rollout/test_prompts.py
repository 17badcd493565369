"""RL prompt sources read datasets as every trainer does: JSON Lines, Parquet and saved HF datasets give
the same rows, and a file of another name is still read as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.errors import PosttrainError
from posttrain.rollout.batch import PROMPT_KEY
from posttrain.rollout.prompts import DatasetPrompts, make_prompt_source
from posttrain.trainers.rl.config import DataSection

ROWS = [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(5)]


def _source(path: Path, **options: object) -> DatasetPrompts:
    cfg = DataSection(task=None, path=str(path), prompt_column="question", eval_size=2, **options)
    source = make_prompt_source(cfg)
    assert isinstance(source, DatasetPrompts)
    return source


def _write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def _expected() -> list[dict[str, object]]:
    return [{"answer": row["answer"], PROMPT_KEY: [{"role": "user", "content": row["question"]}]} for row in ROWS]


def test_parquet_prompts_are_the_jsonl_prompts(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "q.parquet")
    jsonl, parquet = _source(_write_jsonl(tmp_path / "q.jsonl")), _source(tmp_path / "q.parquet")
    assert parquet.train_rows == jsonl.train_rows == _expected()[:3]
    assert parquet.held_out(2) == jsonl.held_out(2) == _expected()[3:]
    assert parquet.sample(6) == jsonl.sample(6)  # same seed, same rows: the same draws


def test_saved_hf_dataset_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert _source(tmp_path / "ds").train_rows == _expected()[:3]


def test_a_file_of_any_name_is_read_as_json(tmp_path):
    assert _source(_write_jsonl(tmp_path / "prompts.data")).held_out(2) == _expected()[3:]


def test_a_missing_prompt_column_names_the_parquet_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(PosttrainError, match=r"bad\.parquet:row 1: no prompt column 'question'"):
        _source(tmp_path / "bad.parquet")

"""Readers: each file type yields the same rows, with the line (or row) number of each."""

from __future__ import annotations

import gzip
import json

import pytest

from posttrain.data.readers import read_rows, row_location
from posttrain.data.validate import DataError

ROWS = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "ü?", "completion": "ja"}, {"prompt": "x", "completion": "y"}]


def jsonl_bytes(rows):
    return b"".join(json.dumps(row, ensure_ascii=False).encode() + b"\n" for row in rows)


def test_jsonl_with_blank_lines_and_bom(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + jsonl_bytes(ROWS[:1]) + b"\n   \n" + jsonl_bytes(ROWS[1:]))
    assert list(read_rows(path)) == [(1, ROWS[0]), (4, ROWS[1]), (5, ROWS[2])]
    assert row_location(path, 4) == f"{path}:4"


def test_jsonl_gz(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl_bytes(ROWS)))
    assert [row for _, row in read_rows(path)] == ROWS


def test_json_array_keeps_line_numbers(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS, indent=2, ensure_ascii=False))  # each object spans 4 lines
    assert list(read_rows(path)) == [(2, ROWS[0]), (6, ROWS[1]), (10, ROWS[2])]
    (tmp_path / "empty.json").write_text("[ ]")
    assert list(read_rows(tmp_path / "empty.json")) == []


def test_json_array_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"a": 1},\n{"a": 2,,}\n]')
    with pytest.raises(DataError, match=r"d\.json:3: invalid JSON array"):
        list(read_rows(path))


def test_bad_json_lines_go_to_on_error_and_reading_continues(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl_bytes(ROWS[:1]) + b'{"prompt": "a", \n' + b'\xff\xfe{"x": 1}\n' + b"[1, 2]\n"
                     + jsonl_bytes(ROWS[1:2]))
    errors = []
    rows = list(read_rows(path, on_error=lambda n, reason: errors.append((n, reason))))
    assert rows == [(1, ROWS[0]), (5, ROWS[1])]
    assert [n for n, _ in errors] == [2, 3, 4]
    assert "invalid JSON" in errors[0][1] and "invalid UTF-8" in errors[1][1] and "expected a JSON object" in errors[2][1]
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON"):  # without on_error: an error at once
        list(read_rows(path))


def test_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert list(read_rows(path)) == [(1, ROWS[0]), (2, ROWS[1]), (3, ROWS[2])]
    assert row_location(path, 2) == f"{path}:row 2"


def test_parquet_with_message_lists(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    assert [row for _, row in read_rows(tmp_path / "m.parquet")] == rows


def test_datasets_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert [row for _, row in read_rows(tmp_path / "ds")] == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(tmp_path / "dd"))
    assert [row for _, row in read_rows(tmp_path / "dd", split="test")] == ROWS[2:]
    assert list(read_rows(tmp_path / "dd"))[1] == (2, ROWS[1])  # split defaults to train
    with pytest.raises(DataError, match="no split 'validation'"):
        list(read_rows(tmp_path / "dd", split="validation"))


def test_datasets_to_json_writes_json_lines_we_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).to_json(str(tmp_path / "d.json"))
    assert [row for _, row in read_rows(tmp_path / "d.json")] == ROWS


def test_unknown_paths_and_types(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(read_rows(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown dataset file type"):
        list(read_rows(tmp_path / "d.csv"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="not a dataset directory"):
        list(read_rows(tmp_path / "dir"))


def test_leading_blank_lines_and_a_multi_line_object(tmp_path):
    (tmp_path / "a.json").write_text("\n\n" + json.dumps(ROWS[:2]))
    assert list(read_rows(tmp_path / "a.json")) == [(3, ROWS[0]), (3, ROWS[1])]
    (tmp_path / "b.jsonl").write_text("\n" + json.dumps(ROWS[0]) + "\n")
    assert list(read_rows(tmp_path / "b.jsonl")) == [(2, ROWS[0])]
    (tmp_path / "c.json").write_text(json.dumps(ROWS[0], indent=2))
    with pytest.raises(DataError, match="one JSON object spread over many lines"):
        list(read_rows(tmp_path / "c.json"))

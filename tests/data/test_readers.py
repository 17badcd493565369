"""Readers: each file type yields the same rows, with the line (or row) number of each."""

from __future__ import annotations

import gzip
import json
import re
import sys

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
    with pytest.raises(DataError, match=r"d\.json:3:9: invalid JSON array: Expecting property name"):
        list(read_rows(path))


@pytest.mark.parametrize(
    "text, where",
    [
        ('[\n{"a": 1},\n{"a": 2\n', "3:8"),  # cut short: blamed after its last character, not on line 4
        ('[\n{"a": 1}\n\n', "2:9"),  # the closing bracket is missing
        ('[\n  {"a": 1} {"a": 2}]', "2:12"),  # no comma between items: where the next item starts
    ],
)
def test_json_array_errors_name_line_and_column(tmp_path, text, where):
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"d\.json:{where}: invalid JSON array"):
        list(read_rows(path))


def test_bad_json_lines_go_to_on_error_and_reading_continues(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        jsonl_bytes(ROWS[:1]) + b'{"prompt": "a", \n' + b'\xff\xfe{"x": 1}\n' + b"[1, 2]\n" + jsonl_bytes(ROWS[1:2])
    )
    errors = []
    rows = list(read_rows(path, on_error=lambda n, column, reason: errors.append((n, column, reason))))
    assert rows == [(1, ROWS[0]), (5, ROWS[1])]
    assert errors == [
        (2, 16, "invalid JSON: Expecting property name enclosed in double quotes"),
        (3, 1, "invalid UTF-8 (byte 0xff)"),
        (4, None, "expected a JSON object, got list"),
    ]
    with pytest.raises(DataError, match=r"d\.jsonl:2:16: invalid JSON"):  # without on_error: an error at once
        list(read_rows(path))


@pytest.mark.parametrize(
    "line, column, reason",
    [
        # cut short: the decoder runs out at the newline; the place is just after the line's last character
        (b'{"prompt": "a", "completion": "b"\n', 34, "invalid JSON: Expecting ',' delimiter"),
        (b'{"prompt": "a", "completion": "b"  \r\n', 34, "invalid JSON: Expecting ',' delimiter"),
        (b'{"prompt": "a" "completion": "b"}\n', 16, "invalid JSON: Expecting ',' delimiter"),
        (b'  {"prompt": tru}\n', 14, "invalid JSON: Expecting value"),
        ('{"prompt": "ü'.encode() + b'\xff"}\n', 14, "invalid UTF-8 (byte 0xff)"),  # characters, not bytes
    ],
)
def test_a_bad_line_is_reported_at_its_own_line_and_column(tmp_path, line, column, reason):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl_bytes(ROWS[:2]) + line + jsonl_bytes(ROWS[2:]))
    errors = []
    rows = list(read_rows(path, on_error=lambda n, col, why: errors.append((n, col, why))))
    assert [n for n, _ in rows] == [1, 2, 4] and errors == [(3, column, reason)]
    with pytest.raises(DataError, match=rf"^{re.escape(f'{path}:3:{column}: {reason}')}$"):
        list(read_rows(path))


def test_a_cut_last_line_and_a_bom_line_keep_their_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl_bytes(ROWS[:1]) + b'{"prompt": "a"')  # no newline at the end: cut by a crash
    with pytest.raises(DataError, match=rf"^{path}:2:15: invalid JSON: Expecting ',' delimiter$"):
        list(read_rows(path))
    path.write_bytes(b'\xef\xbb\xbf{"p": "\xff"}\n')  # columns count from after the byte-order mark
    with pytest.raises(DataError, match=rf"^{path}:1:8: invalid UTF-8 \(byte 0xff\)$"):
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
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    ).save_to_disk(str(tmp_path / "dd"))
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


def test_lines_the_json_parser_cannot_take_are_bad_rows_too(tmp_path):
    """Nesting deeper than the parser's recursion limit, and an integer past Python's digit limit, end
    json.loads in RecursionError / ValueError rather than JSONDecodeError: still one bad row each."""
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("this interpreter has no integer digit limit")
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        jsonl_bytes(ROWS[:1])
        + b"[" * 100_000
        + b"\n"  # past any recursion limit
        + b'{"n": '
        + b"1" * (limit + 1)
        + b"}\n"
        + jsonl_bytes(ROWS[1:2])
    )
    errors = []
    rows = list(read_rows(path, on_error=lambda n, column, reason: errors.append((n, column, reason))))
    assert rows == [(1, ROWS[0]), (4, ROWS[1])]
    assert errors[0] == (2, None, "invalid JSON: nested too deeply")
    assert errors[1][:2] == (3, None) and errors[1][2].startswith(f"invalid JSON: Exceeds the limit ({limit} digits)")

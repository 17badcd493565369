"""Bad rows: each class is reported with file:line and skipped; too many abort the run."""

from __future__ import annotations

import json
import logging

import pytest

from posttrain.data.config import DataConfig
from posttrain.data.dataset import build_sft_rows, read_examples
from posttrain.data.validate import DataError
from tests.data.tiny import tiny_tokenizer

GOOD = {"prompt": "What is two plus three?", "completion": "five"}
U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731


def write_lines(path, lines):
    path.write_bytes(
        b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    )
    return path


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def test_each_bad_row_class_is_reported_with_file_line_and_skipped(tmp_path, tokenizer, caplog):
    path = write_lines(
        tmp_path / "pc.jsonl",
        [
            GOOD,  # 1
            {"prompt": "q"},  # 2 missing field
            {"prompt": "q", "completion": ""},  # 3 empty completion
            b'{"prompt": "q", "completion": "\xff"}',  # 4 bad UTF-8
            b'{"prompt": "q", "completion": }',  # 5 invalid JSON
            {"prompt": "q " * 200, "completion": "a"},  # 6 over-long (max_length 64)
            GOOD,
            GOOD,
            GOOD,
            GOOD,  # 7-10
        ],
    )
    cfg = DataConfig(path=str(path), max_length=64, max_bad_row_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        result = build_sft_rows(cfg, tokenizer)
    assert len(result.rows) == 5 and result.rows_read == 10
    got = {bad.location: bad.reason for bad in result.bad_rows}
    # undecodable lines are found while reading, and name the column where decoding stopped
    assert list(got) == [f"{path}:4:32", f"{path}:5:31"] + [f"{path}:{n}" for n in (2, 3, 6)]
    assert "missing field 'completion'" in got[f"{path}:2"]
    assert "empty completion" in got[f"{path}:3"]
    assert got[f"{path}:4:32"] == "invalid UTF-8 (byte 0xff)"
    assert got[f"{path}:5:31"] == "invalid JSON: Expecting value"
    assert "too long" in got[f"{path}:6"] and "max_length 64" in got[f"{path}:6"]
    for n in (2, 3, 4, 5, 6):  # a warning per bad row, naming file:line
        assert f"{path}:{n}:" in caplog.text
    assert "skipped 5 of 10 rows" in caplog.text


def test_conversation_row_classes(tmp_path, tokenizer, caplog):
    path = write_lines(
        tmp_path / "chat.jsonl",
        [
            {"messages": [U("hi"), A("yo")]},
            {"messages": [U("hi"), U("again"), A("yo")]},  # 2 non-alternating roles
            {"messages": [U("hi"), {"role": "robot", "content": "beep"}]},  # 3 unknown role
            {"messages": [U("hi"), A("   ")]},  # 4 empty completion
            {"messages": [U("hi"), A("yo")]},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        result = build_sft_rows(DataConfig(path=str(path), max_bad_row_fraction=0.9), tokenizer)
    assert len(result.rows) == 2
    reasons = {bad.location: bad.reason for bad in result.bad_rows}
    assert "roles do not alternate" in reasons[f"{path}:2"]
    assert "unknown role 'robot'" in reasons[f"{path}:3"]
    assert "no assistant message with text" in reasons[f"{path}:4"]
    assert f"{path}:3: messages[1] has unknown role 'robot'" in caplog.text


def test_identical_pairs_are_reported_with_file_line_and_skipped(tmp_path, caplog):
    pair = {"prompt": "q", "chosen": " yes", "rejected": " no"}
    path = write_lines(
        tmp_path / "pairs.jsonl",
        [
            pair,
            {"prompt": "q", "chosen": " yes", "rejected": " yes"},  # 2 identical strings
            {"prompt": [U("q")], "chosen": [A("yes")], "rejected": [A("yes")]},  # 3 identical messages
            pair,
        ],
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.data"):
        loaded = read_examples(DataConfig(path=str(path), max_bad_row_fraction=0.5))
    assert loaded.format == "preference" and len(loaded.examples) == 2
    assert [(bad.location, bad.reason) for bad in loaded.bad.rows] == [
        (f"{path}:2", "chosen and rejected are identical"),
        (f"{path}:3", "chosen and rejected are identical"),
    ]
    assert f"skipping bad row {path}:2: chosen and rejected are identical" in caplog.text


def test_truncate_instead_of_skip(tmp_path, tokenizer):
    path = write_lines(tmp_path / "d.jsonl", [{"prompt": "q", "completion": "a " * 200}, GOOD])
    result = build_sft_rows(DataConfig(path=str(path), max_length=64, overlong="truncate"), tokenizer)
    assert [len(row) for row in result.rows][0] == 64 and not result.bad_rows
    # truncation that leaves no completion token makes the row bad
    path = write_lines(tmp_path / "e.jsonl", [{"prompt": "q " * 200, "completion": "a"}] + [GOOD] * 30)
    result = build_sft_rows(DataConfig(path=str(path), max_length=64, overlong="truncate"), tokenizer)
    assert len(result.bad_rows) == 1 and "no completion tokens within max_length" in result.bad_rows[0].reason


def test_abort_above_the_bad_row_fraction(tmp_path, tokenizer):
    lines = [GOOD] * 18 + [{"prompt": "q"}] * 2  # 10% bad
    path = write_lines(tmp_path / "d.jsonl", lines)
    with pytest.raises(
        DataError, match=r"2 of 20 rows are bad \(10\.0%\), above max_bad_row_fraction=0\.05.*d\.jsonl:19"
    ):
        build_sft_rows(DataConfig(path=str(path)), tokenizer)
    assert len(build_sft_rows(DataConfig(path=str(path), max_bad_row_fraction=0.1), tokenizer).rows) == 18
    all_bad = write_lines(tmp_path / "bad.jsonl", [{"prompt": "q"}])
    with pytest.raises(DataError, match="1 of 1 rows are bad"):  # nothing left: an error at any threshold
        build_sft_rows(DataConfig(path=str(all_bad), format="prompt_completion", max_bad_row_fraction=1.0), tokenizer)


def test_format_detection_and_column_mapping(tmp_path, tokenizer):
    path = write_lines(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 3)
    with pytest.raises(DataError, match=r"cannot detect the row format from the fields \['answer', 'question'\]"):
        read_examples(DataConfig(path=str(path)))
    loaded = read_examples(DataConfig(path=str(path), columns={"prompt": "question", "completion": "answer"}))
    assert loaded.format == "prompt_completion" and len(loaded.examples) == 3
    # a minority of odd rows does not change the detected format; they are bad rows of it
    path = write_lines(tmp_path / "mix.jsonl", [GOOD] * 5 + [{"text": "t"}])
    loaded = read_examples(DataConfig(path=str(path), max_bad_row_fraction=0.5))
    assert loaded.format == "prompt_completion" and len(loaded.bad) == 1


def test_unpaired_preference_is_refused_for_sft(tmp_path, tokenizer):
    path = write_lines(tmp_path / "kto.jsonl", [{"prompt": "q", "completion": "a", "label": True}])
    with pytest.raises(DataError, match="unpaired_preference rows cannot be used for SFT"):
        build_sft_rows(DataConfig(path=str(path)), tokenizer)


def test_data_config_validation():
    from posttrain.config import load_config
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="path: a dataset file"):
        load_config(DataConfig, overrides=[])
    with pytest.raises(ConfigError, match="unknown format 'csv'"):
        load_config(DataConfig, overrides=["path=x.jsonl", "format=csv"])
    with pytest.raises(ConfigError, match="overlong"):
        load_config(DataConfig, overrides=["path=x.jsonl", "overlong=drop"])

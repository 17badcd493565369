"""Reading rows from disk: JSON Lines (optionally gzipped), JSON arrays, Parquet, and HF `datasets`
directories written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`.

`read_rows(path)` yields `(n, row)`: `n` is the 1-based line number for JSON files and the 1-based
row number for Parquet and Arrow; `row_location(path, n)` spells the matching `file:line` or
`file:row N`. A JSON line that cannot be decoded (bad UTF-8, invalid JSON, not an object) is a bad
row: it goes to `on_error(n, column, reason)` and reading continues; without `on_error` it is a
DataError. `column` is the 1-based character column within that line where decoding stopped (None
when no single place is to blame), so `row_location(path, n, column)` reads `file:3:17` as editors
and compilers write it. `read_json_rows` is the JSON half alone, for files read as JSON whatever
their name (the prompt files of the RL trainers, tasks and `generate`).
Parquet and Arrow need `pyarrow` (imported only for those); the `datasets` library is not needed.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from posttrain.data.validate import DataError

Row = dict[str, Any]
OnError = Callable[[int, int | None, str], None]  # (line, column or None, reason)

JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
_GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"
_BLANK = _BOM + b" \t\r\n"  # a UTF-8 byte-order mark and whitespace
_JSON_SPACE = " \t\r\n"


def read_rows(path: str | Path, *, split: str = "train", on_error: OnError | None = None) -> Iterator[tuple[int, Row]]:
    """Rows of a dataset file or HF dataset directory, in file order. `split` picks the split of a
    saved `DatasetDict`; it is ignored for a single file or a single saved `Dataset`."""
    path = Path(path)
    if path.is_dir():
        yield from _read_arrow_files(_saved_dataset_files(path, split))
        return
    if not path.is_file():
        raise DataError(f"{path}: no such file or directory")
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from _read_parquet(path)
    elif name.endswith(".arrow"):
        yield from _read_arrow_files([path])
    elif name.endswith(JSON_SUFFIXES):
        yield from _read_json(path, on_error)
    else:
        raise DataError(
            f"{path}: unknown dataset file type (expected {', '.join(JSON_SUFFIXES + COLUMNAR_SUFFIXES)} "
            "or a directory written by datasets' save_to_disk)"
        )


def row_location(path: str | Path, n: int, column: int | None = None) -> str:
    """`path:n` (or `path:n:column`) for line-numbered files, `path:row n` for columnar ones."""
    path = Path(path)
    if path.is_dir() or path.name.lower().endswith(COLUMNAR_SUFFIXES):
        return f"{path}:row {n}"
    return f"{path}:{n}" if column is None else f"{path}:{n}:{column}"


# ----------------------------------------------------------------------------- JSON


def _open_bytes(path: Path) -> Any:
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_json_rows(path: str | Path, on_error: OnError | None = None) -> Iterator[tuple[int, Row]]:
    """`(line, row)` of a JSON Lines file (optionally gzipped) or a JSON array of objects, whatever the
    file's name; bad lines as in `read_rows`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    yield from _read_json(path, on_error)


def _read_json(path: Path, on_error: OnError | None) -> Iterator[tuple[int, Row]]:
    """JSON Lines, or one JSON array of objects (what `json.dump(rows)` writes); decided by the first
    non-blank character. `Dataset.to_json` writes JSON Lines, even for a `.json` name."""
    fail = on_error or _raise_at(path)
    with _open_bytes(path) as f:
        lines: list[bytes] = []  # up to and including the first non-blank line: it decides what the file is
        try:
            while not lines or not lines[-1].strip(_BLANK):
                lines.append(f.readline())
                if not lines[-1]:
                    return
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise DataError(f"{path}: cannot read: {e}") from None
        first = lines[-1].strip(_BLANK)
        if first.startswith(b"["):
            yield from _read_json_array(path, b"".join(lines) + f.read())
            return
        if first == b"{":
            raise DataError(
                f"{path}: one JSON object spread over many lines; expected JSON Lines "
                "(one object per line) or a JSON array of objects"
            )
        number = 0
        line = lines.pop(0)
        while line:
            number += 1
            if line.strip():
                row, column, reason = _decode_line(line, number == 1)
                if reason is None:
                    yield number, row
                else:
                    fail(number, column, reason)
            try:
                line = lines.pop(0) if lines else f.readline()
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                raise DataError(f"{path}:{number + 1}: cannot read (truncated or corrupt file?): {e}") from None


def utf8_error(raw: bytes) -> tuple[int, str] | None:
    """None for valid UTF-8, else (column, reason) of the first bad byte: the column counts the characters
    before it from 1, as every reader's `file:line:column` does."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return len(raw[: e.start].decode("utf-8")) + 1, f"invalid UTF-8 (byte {raw[e.start]:#04x})"
    return None


def _decode_line(raw: bytes, first_line: bool) -> tuple[Row | None, int | None, str | None]:
    """(row, None, None), or (None, column, reason) for a line that is not one JSON object. `raw` is
    the line as read, newline included; columns count characters of the line (after a first line's
    byte-order mark), from 1."""
    if first_line:
        raw = raw.removeprefix(_BOM)
    bad = utf8_error(raw)
    if bad is not None:
        return None, *bad
    text = raw.decode("utf-8")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return None, _json_error_at(text, e.pos)[1], f"invalid JSON: {e.msg}"
    except (RecursionError, ValueError) as e:  # nesting too deep for the parser; an int past Python's digit limit
        return None, None, f"invalid JSON: {'nested too deeply' if isinstance(e, RecursionError) else e}"
    if not isinstance(row, dict):
        return None, None, f"expected a JSON object, got {type(row).__name__}"
    return row, None, None


def _json_error_at(text: str, offset: int) -> tuple[int, int]:
    """(line, column) of a JSON decoder's error `offset` in `text`. Where the decoder ran out of input
    (an unclosed object or array), the place to blame is just after the last non-blank character,
    not the start of the empty line after the final newline."""
    return _position(text, min(offset, len(text.rstrip(_JSON_SPACE))))


def _position(text: str, offset: int) -> tuple[int, int]:
    """The 1-based (line, column) of character `offset` of `text`."""
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1


def _read_json_array(path: Path, data: bytes) -> Iterator[tuple[int, Row]]:
    """Decode element by element so each row keeps the line it starts on. A syntax error ends the
    file (there is no next line to resynchronise on), so it is a DataError, not a bad row."""
    data = data.removeprefix(_BOM)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start].decode("utf-8")  # the bytes before the bad one decode
        line, column = _position(before, len(before))
        raise DataError(
            f"{path}:{line}:{column}: invalid UTF-8 (byte {data[e.start]:#04x}) in a JSON array file"
        ) from None
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line, counted_to = 1, 0

    def line_at(offset: int) -> int:
        nonlocal line, counted_to
        line += text.count("\n", counted_to, offset)
        counted_to = offset
        return line

    def skip(chars: str) -> None:
        nonlocal pos
        while pos < len(text) and text[pos] in chars:
            pos += 1

    skip(" \t\r\n")
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        skip(" \t\r\n")
        start = line_at(pos)
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            at = ":".join(map(str, _json_error_at(text, e.pos)))
            raise DataError(f"{path}:{at}: invalid JSON array: {e.msg}") from None
        except (RecursionError, ValueError) as e:
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise DataError(f"{path}:{start}: invalid JSON array: {reason}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{start}: array items must be JSON objects, got {type(row).__name__}")
        yield start, row
        skip(" \t\r\n")
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos < len(text) and text[pos] == "]":
            return
        at = ":".join(map(str, _json_error_at(text, pos)))
        raise DataError(f"{path}:{at}: invalid JSON array: expected ',' or ']'")


def _raise_at(path: Path) -> OnError:
    def fail(number: int, column: int | None, reason: str) -> None:
        raise DataError(f"{row_location(path, number, column)}: {reason}")

    return fail


# ----------------------------------------------------------------------------- Parquet and Arrow


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading Parquet or Arrow datasets needs pyarrow: pip install pyarrow") from None
    return pyarrow


def _read_parquet(path: Path) -> Iterator[tuple[int, Row]]:
    pa = _pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    number = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _read_arrow_files(files: list[Path]) -> Iterator[tuple[int, Row]]:
    """HF datasets store Arrow IPC *streams*; a plain Arrow IPC file is accepted too. Row numbers run
    on across the shards of one dataset."""
    pa = _pyarrow()
    number = 0
    for file in files:
        try:
            source = pa.memory_map(str(file))
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
            batches = (
                (reader.get_batch(i) for i in range(reader.num_record_batches))
                if isinstance(reader, pa.ipc.RecordBatchFileReader)
                else reader
            )
            for batch in batches:
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a readable Arrow file: {e}") from None


def _saved_dataset_files(directory: Path, split: str) -> list[Path]:
    """The Arrow shards of a `save_to_disk` directory (a Dataset, or one split of a DatasetDict)."""
    dict_file = directory / "dataset_dict.json"
    if dict_file.is_file():
        splits = _json_file(dict_file).get("splits", [])
        if split not in splits:
            raise DataError(f"{directory}: no split {split!r} in this DatasetDict (splits: {', '.join(splits)})")
        directory = directory / split
    state_file = directory / "state.json"
    if not state_file.is_file():
        found = sorted(p.name for p in directory.iterdir())[:8]
        raise DataError(
            f"{directory}: not a dataset directory (expected state.json from datasets' save_to_disk, "
            f"or dataset_dict.json; found: {', '.join(found) or 'nothing'})"
        )
    entries = _json_file(state_file).get("_data_files", [])
    files = [directory / entry["filename"] for entry in entries if isinstance(entry, dict) and "filename" in entry]
    if not files:
        raise DataError(f"{state_file}: lists no data files")
    for file in files:
        if not file.is_file():
            raise DataError(f"{file}: listed in {state_file.name} but missing")
    return files


def _json_file(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object")
    return value

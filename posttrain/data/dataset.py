"""The data pipeline: read rows, detect the format, parse and check each row, tokenize, enforce
max_length, and account for bad rows (reported with file:line, skipped, abort above a fraction).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from posttrain.data.config import DataConfig
from posttrain.data.formats import FORMATS, Example, detect_format, to_chat
from posttrain.data.readers import read_rows, row_location
from posttrain.data.tokenize import ChatTokenizer, TokenizedRow, fit_to_length, tokenize_sft
from posttrain.data.validate import BadRow, BadRowLog, DataError, RowError

T = TypeVar("T")

DETECT_ROWS = 100  # rows whose keys vote on the format when format is "auto"


@dataclass
class LoadedExamples:
    source: str
    format: str
    examples: list[tuple[str, Example]]  # (location, example) of the good rows
    rows_read: int
    bad: BadRowLog = field(default_factory=BadRowLog)

    def convert_all(self, convert: Callable[[Example], T], max_bad_fraction: float) -> list[T]:
        """`convert` (e.g. tokenize) every example; a RowError logs the row as bad and skips it; DataError
        when the bad rows (read and converted together) exceed `max_bad_fraction` of the rows read."""
        out = []
        for where, example in self.examples:
            try:
                out.append(convert(example))
            except RowError as e:
                self.bad.add(where, str(e))
        self.bad.check_fraction(self.source, self.rows_read, max_bad_fraction)
        return out


def rename_columns(row: Mapping[str, Any], columns: Mapping[str, str]) -> dict[str, Any]:
    """{format field: file column}: the row with each mapped column under its format field name."""
    out = dict(row)
    for target, source in columns.items():
        if source not in out:
            raise RowError(f"missing field {source!r} (data.columns maps it to {target!r})")
        out[target] = out.pop(source)
    return out


def _vote_format(rows: Sequence[Mapping[str, Any]], source: str) -> str:
    votes = Counter(fmt for fmt in map(detect_format, rows) if fmt is not None)
    if not votes:
        keys = sorted(set().union(*(row.keys() for row in rows))) if rows else []
        raise DataError(
            f"{source}: cannot detect the row format from the fields {keys} (expected e.g. prompt/completion, "
            f"messages, text or chosen/rejected; map other names with data.columns, or set data.format)"
        )
    return votes.most_common(1)[0][0]


def peek_format(cfg: DataConfig, path: str | Path | None = None) -> str:
    """The format `read_examples` will use for `path` (default `cfg.path`), reading only the rows that vote
    on it: lets a trainer pick its data path (or refuse the file) before it loads a model."""
    if cfg.format != "auto":
        return cfg.format
    path = Path(path if path is not None else cfg.path)
    head = itertools.islice(read_rows(path, split=cfg.split, on_error=lambda n, column, reason: None), DETECT_ROWS)
    renamed = (_try(rename_columns, row, cfg.columns) for _, row in head)
    return _vote_format([row for row in renamed if isinstance(row, dict)], str(path))


def read_examples(cfg: DataConfig, path: str | Path | None = None, bad: BadRowLog | None = None) -> LoadedExamples:
    """Parse and check every row of `path` (default `cfg.path`). Bad rows go to `bad`; the caller
    decides when to apply the bad-row threshold (after tokenization adds its own rejects)."""
    path = Path(path if path is not None else cfg.path)
    bad = bad if bad is not None else BadRowLog()
    source = str(path)
    undecodable = 0

    def on_error(n: int, column: int | None, reason: str) -> None:  # a line that is not a JSON object: a bad row too
        nonlocal undecodable
        undecodable += 1
        bad.add(row_location(path, n, column), reason)

    rows: Iterator[tuple[int, dict[str, Any]]] = read_rows(path, split=cfg.split, on_error=on_error)
    if cfg.max_rows is not None:
        rows = itertools.islice(rows, cfg.max_rows)
    renamed: Iterator[tuple[int, dict[str, Any] | RowError]] = (
        (n, _try(rename_columns, row, cfg.columns)) for n, row in rows
    )
    fmt = cfg.format
    if fmt == "auto":
        head = list(itertools.islice(renamed, DETECT_ROWS))
        fmt = _vote_format([row for _, row in head if isinstance(row, dict)], source)
        renamed = itertools.chain(head, renamed)
    parse = FORMATS[fmt]
    examples: list[tuple[str, Example]] = []
    decoded = 0
    for n, row in renamed:
        where = row_location(path, n)
        decoded += 1
        try:
            if isinstance(row, RowError):
                raise row
            example = parse(row)
        except RowError as e:
            bad.add(where, str(e))
            continue
        examples.append((where, to_chat(example) if cfg.as_chat else example))
    return LoadedExamples(source, fmt, examples, decoded + undecodable, bad)


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except RowError as e:
        return e


@dataclass
class SFTRows:
    rows: list[TokenizedRow]
    format: str
    rows_read: int
    bad_rows: list[BadRow]


def build_sft_rows(
    cfg: DataConfig, tokenizer: ChatTokenizer, completion_only: bool = True, path: str | Path | None = None
) -> SFTRows:
    """Read, check and tokenize a dataset for SFT; raise DataError above cfg.max_bad_row_fraction."""
    loaded = read_examples(cfg, path)

    def convert(example: Example) -> TokenizedRow:
        row = tokenize_sft(tokenizer, example, completion_only=completion_only)
        return fit_to_length(row, cfg.max_length, cfg.overlong)

    try:
        rows = loaded.convert_all(convert, cfg.max_bad_row_fraction)
    except TypeError as e:  # a format SFT cannot train on: every row would fail, so stop at the first
        raise DataError(f"{loaded.source}: {loaded.format} rows cannot be used for SFT: {e}") from None
    return SFTRows(rows, loaded.format, loaded.rows_read, loaded.bad.rows)


def split_holdout(items: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, held out): a seeded random `fraction` of the items held out (at least one if fraction > 0)."""
    if fraction <= 0:
        return list(items), []
    count = max(1, round(fraction * len(items)))
    if count >= len(items):
        raise DataError(f"eval_fraction={fraction} leaves no training rows out of {len(items)}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]

"""Read back what a W&B run wrote offline: its `run-<id>.wandb` file, through W&B's own record schema.

The file is a LevelDB-style log (what W&B's `wandb sync` uploads): a 7-byte header (":W&B", magic 0xBEE1,
version 0), then 32 KiB blocks of chunks, each with a 7-byte header (crc32c, length, type: FULL, or FIRST /
MIDDLE / LAST of a record split over blocks). Each record is a protobuf `wandb_internal_pb2.Record`."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    name: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> the history row logged at it


def _payloads(data: bytes):
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # too little room for a chunk header: the block is padded
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            parts.append(chunk)
            yield b"".join(parts)


def read_offline_run(run_dir: Path, wait_s: float = 60.0) -> OfflineRun:
    """The one offline W&B run under `<run_dir>/wandb/`, once its writer has finished it.

    `run.finish()` returns before W&B's service process has flushed the file: the reader waits (up to
    `wait_s`) for the run's last record, `exit`."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run in {run_dir}, found {files}"
    deadline = time.monotonic() + wait_s
    while True:
        records = []
        for payload in _payloads(files[0].read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < deadline, f"{files[0]}: no exit record after {wait_s}s"
        time.sleep(0.1)
    run = OfflineRun()
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.project = record.run.display_name, record.run.project
            run.config.update(_items(record.run.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            row = _items(record.history.item)
            run.rows.setdefault(record.history.step.num, {}).update(row)
    run.config = {k: v for k, v in run.config.items() if k != "_wandb"}  # W&B's own bookkeeping
    return run


def _items(items: Any) -> dict[str, Any]:
    # A flat key is `key`, or a one-element `nested_key` (W&B's path of a nested dict's keys); values are JSON,
    # with NaN / Infinity as Python's json writes them.
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}

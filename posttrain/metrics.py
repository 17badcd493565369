"""Training metrics: one JSON object per line in `<run>/metrics.jsonl`, and the same records to the
experiment trackers of `log.report_to` (TensorBoard, W&B, Trackio, MLflow: `posttrain.trackers`).

Each record is `{"step": int, "time": unix seconds, **metrics}`. The file is opened for append
(a resumed run continues it) and flushed after every line, so a crashed process loses nothing
it has logged. Create the logger on rank 0 only: two writers would interleave lines.

Non-finite floats are written as the strings "nan", "inf" and "-inf". Strict JSON has no NaN,
and null would lose the difference between a 0/0 (nan) and an overflow (inf), which is the first
thing one wants to know about a diverged run. `read_metrics` turns those strings back into floats,
so string metrics should not use these three values.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.trackers import close_all, open_trackers, resolve_report_to
from posttrain.trackers.tensorboard_tracker import TENSORBOARD_DIR  # noqa: F401 (this module's name before)

METRICS_FILE = "metrics.jsonl"
DEFAULT_PROJECT = "posttrain"
RESERVED_KEYS = ("step", "time")
_NON_FINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricsLogger:
    """Appends metric records to `<run_dir>/metrics.jsonl` and sends each to the trackers in `report_to`.

    The trackers' run is named after the run directory and gets `config` (the resolved config, as in
    config.yaml); `project` is the W&B / Trackio project and the MLflow experiment. `tensorboard=True` is
    the older spelling of `report_to=["tensorboard"]`."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = False,
        *,
        report_to: Sequence[str] | str | None = (),
        config: Mapping[str, Any] | None = None,
        project: str = DEFAULT_PROJECT,
    ):
        run_dir = Path(run_dir)
        self.path = run_dir / METRICS_FILE
        try:
            names = resolve_report_to(report_to, tensorboard)
        except ValueError as e:
            raise PosttrainError(f"log.{e}") from None
        self._trackers = open_trackers(names, project, run_dir.resolve().name, dict(config or {}), run_dir)
        try:
            self._file = open(self.path, "a", encoding="utf-8")
        except BaseException:
            close_all(self._trackers)
            raise

    def log(self, step: int, metrics: dict[str, float | int | str]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: logger is closed")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        record: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be strings, got {key!r}")
            if key in RESERVED_KEYS:
                raise ValueError(f"metric name {key!r} is reserved for the record itself")
            record[key] = _to_json_value(key, value)
        # One write per record: a crash can cut at most the last line, which read_metrics skips.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._trackers:
            # What the file holds, read back as read_metrics does: "nan" / "inf" are floats again.
            values = {key: _from_json_value(value) for key, value in record.items() if key not in RESERVED_KEYS}
            for tracker in self._trackers:
                tracker.log(values, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        close_all(trackers)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(path: str | Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """All records of a `metrics.jsonl` (or of the one in a run directory), in file order.

    Strict: a malformed line, a record that is not an object or has no integer `step` is an error naming
    the file and line. The one exception is a last line without its newline (a run still writing, or the
    write a crash cut): skipped, and said in `notes` when the caller passes a list."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PosttrainError(f"{path}: metrics file not found") from None
    except UnicodeDecodeError as e:
        raise PosttrainError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: still being written, or cut by a crash
                if notes is not None:
                    notes.append(f"{path.name}:{number}: incomplete last line skipped (run still writing?)")
                break
            raise PosttrainError(f"{path}:{number}: not a JSON record: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise PosttrainError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise PosttrainError(f"{path}:{number}: 'step' must be an integer, got {step!r}")
        records.append({key: _from_json_value(value) for key, value in record.items()})
    return records


def _to_json_value(key: str, value: Any) -> Any:
    # Tensors and numpy scalars both have .item(); only single values make sense as a metric.
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (int, float, str)):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", 1)
        if size != 1:
            raise ValueError(f"metric {key!r} must be a single number, got {size} values")
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    raise TypeError(f"metric {key!r} must be a number or a string, got {type(value).__name__}")


def _from_json_value(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE_TEXT:
        return _NON_FINITE_TEXT[value]
    return value

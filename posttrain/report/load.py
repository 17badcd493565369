"""What a report reads from a run directory: metrics.jsonl (strictly), config.yaml, summary files and
per-step sample files (eval-stepNNNNN.jsonl from the RL trainer), everything but the metrics optional."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.metrics import METRICS_FILE
from posttrain.run_dir import CONFIG_FILE

# MetricsLogger writes non-finite floats as these strings (strict JSON has no NaN).
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# eval-step00020.jsonl: the RL trainer's held-out completions at step 20; samples-step*.jsonl likewise.
SAMPLE_FILE = re.compile(r"^(?:eval|samples)-step(\d+)\.jsonl$")
SUMMARY_FILES = ("summary.json", "data_report.json")
MAX_SAMPLE_ROWS = 1000  # per file: a report shows a handful; never read a huge dump whole


@dataclass
class RunData:
    run_dir: Path
    records: list[dict[str, Any]]
    config_text: str | None = None
    summaries: dict[str, str] = field(default_factory=dict)  # file name -> pretty JSON
    samples: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # step -> sample rows
    notes: list[str] = field(default_factory=list)  # what was skipped, for the reader of the report

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name


def read_metrics_strict(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records of a metrics.jsonl; a malformed line is an error naming the file and line. The one
    exception is a last line without its newline (a run being written or cut by a crash): skipped, noted."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PosttrainError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")
    records, notes = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: still being written
                notes.append(f"{path.name}:{number}: incomplete last line skipped (run still writing?)")
                break
            raise PosttrainError(f"{path}:{number}: not a JSON record: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise PosttrainError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise PosttrainError(f"{path}:{number}: 'step' must be an integer, got {step!r}")
        records.append({k: NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()})
    return records, notes


def _read_samples(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if len(rows) >= MAX_SAMPLE_ROWS:
                notes.append(f"{path.name}: only the first {MAX_SAMPLE_ROWS} samples read")
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                notes.append(f"{path.name}:{number}: not JSON, skipped")
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def load_run(run_dir: str | Path) -> RunData:
    """Read everything a report shows; PosttrainError for a missing directory or metrics file."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise PosttrainError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise PosttrainError(f"{run_dir}: not a directory (expected a run directory holding {METRICS_FILE})")
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise PosttrainError(f"{run_dir}: no {METRICS_FILE} (not a run directory, or the run has not logged yet)")
    records, notes = read_metrics_strict(metrics)
    data = RunData(run_dir, records, notes=notes)
    config = run_dir / CONFIG_FILE
    if config.is_file():
        data.config_text = config.read_text(encoding="utf-8", errors="replace")
    for name in SUMMARY_FILES:
        path = run_dir / name
        if path.is_file():
            try:
                data.summaries[name] = json.dumps(json.loads(path.read_text(encoding="utf-8")), indent=2)
            except (json.JSONDecodeError, UnicodeDecodeError):
                notes.append(f"{name}: not valid JSON, not shown")
    for path in sorted(run_dir.glob("*.jsonl")):
        match = SAMPLE_FILE.match(path.name)
        if match:
            step = int(match.group(1))
            data.samples.setdefault(step, []).extend(_read_samples(path, notes))
    return data

"""What a report reads from a run directory: metrics.jsonl (strictly), config.yaml, summary files and
per-step sample files (eval-stepNNNNN.jsonl from the RL trainer), everything but the metrics optional."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.metrics import METRICS_FILE, read_metrics
from posttrain.run_dir import CONFIG_FILE

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
    notes: list[str] = []
    records = read_metrics(metrics, notes)
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

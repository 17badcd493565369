"""What each tracker holds after a run, read back through the library's own API or files, and what
metrics.jsonl says it should hold."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.metrics import read_metrics


def jsonl_by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's records merged per step (the RL loop logs its final evaluation at the last step
    again), without the record's own `step` and `time`."""
    rows: dict[int, dict[str, Any]] = {}
    for record in read_metrics(run_dir):
        step = record.pop("step")
        record.pop("time")
        rows.setdefault(step, {}).update(record)
    return rows


def jsonl_numbers(run_dir: Path) -> dict[str, list[tuple[int, str]]]:
    """metric -> [(step, repr of the value)] for every int / float logged (repr: nan compares equal to nan)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(key, []).append((record["step"], repr(float(value))))
    return {key: sorted(points) for key, points in out.items()}


def same(a: Any, b: Any) -> bool:
    """Equal values: nan equals nan, an int equals the float it names (JSON writes 1.0 as 1), a bool only a bool."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def assert_rows_hold(
    rows: Mapping[int, Mapping[str, Any]], expected: Mapping[int, Mapping[str, Any]], where: str
) -> None:
    assert set(rows) == set(expected), f"{where}: steps {sorted(rows)} != metrics.jsonl's {sorted(expected)}"
    for step, want in expected.items():
        for key, value in want.items():
            assert key in rows[step], f"{where}: step {step} has no {key!r}"
            assert same(rows[step][key], value), f"{where}: step {step} {key}: {rows[step][key]!r} != {value!r}"


def wandb_rows(run_dir: Path) -> tuple[Any, dict[int, dict[str, Any]]]:
    from tests.trackers.wandb_records import read_offline_run

    run = read_offline_run(run_dir)
    return run, run.rows


def trackio_run(project: str, name: str) -> tuple[Any, dict[int, dict[str, Any]]]:
    """The one Trackio run of `project` called `name`, and its logged rows merged per step."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    runs = [run for run in trackio.Api().runs(project) if run.name == name]
    assert len(runs) == 1, f"trackio project {project}: {len(runs)} runs named {name}"
    rows: dict[int, dict[str, Any]] = {}
    for row in SQLiteStorage.get_logs(project, run_id=runs[0].id):
        rows.setdefault(int(row["step"]), {}).update(row)
    return runs[0], rows


def mlflow_run(tracking_uri: str, experiment: str, name: str) -> tuple[Any, Any]:
    """(the one MLflow run of `experiment` called `name`, its client)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment} at {tracking_uri}"
    runs = [r for r in client.search_runs([found.experiment_id]) if r.info.run_name == name]
    assert len(runs) == 1, f"MLflow experiment {experiment}: {len(runs)} runs named {name}"
    return runs[0], client


def mlflow_numbers(client: Any, run: Any) -> dict[str, list[tuple[int, str]]]:
    return {
        key: sorted((m.step, repr(float(m.value))) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }


def dotted(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config's leaves by dotted key (an empty mapping is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            out.update(dotted(value, name))
        else:
            out[name] = value
    return out

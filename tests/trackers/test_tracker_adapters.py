"""Each tracker adapter on its library, offline: what MetricsLogger wrote to metrics.jsonl is what the
library holds, read back through its own API or files, with the run's name and config."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from posttrain.metrics import MetricsLogger
from tests.trackers.conftest import trackio_dir
from tests.trackers.readback import (
    assert_rows_hold,
    dotted,
    jsonl_by_step,
    jsonl_numbers,
    mlflow_numbers,
    mlflow_run,
    trackio_run,
    wandb_rows,
)

CONFIG = {
    "model": {"name_or_path": "tiny", "dtype": None},
    "optim": {"lr": 1e-05, "betas": [0.9, 0.999]},
    "data": {"columns": {}, "path": "train.jsonl"},
    "log": {"report_to": ["x"], "tensorboard": False},
    "out": "runs/x",
}
# Every kind of value a record may hold: floats, ints, non-finite floats, strings, booleans.
RECORDS = [
    (1, {"loss": 2.5, "lr": 1e-4, "tokens": 128, "phase": "warmup", "clipped": True}),
    (2, {"loss": math.nan, "grad_norm": math.inf, "low": -math.inf, "tokens": 64, "clipped": False}),
    (3, {"loss": 0.125, "eval_loss": 0.25}),
]


def log_run(run_dir, tracker: str, project: str) -> None:
    with MetricsLogger(run_dir, report_to=[tracker], config=CONFIG, project=project) as logger:
        for step, metrics in RECORDS:
            logger.log(step, metrics)


def test_wandb_offline_run_holds_every_record(offline):
    pytest.importorskip("wandb")
    log_run(offline, "wandb", "posttrain-test")
    run, rows = wandb_rows(offline)
    assert run.name == offline.name and run.project == "posttrain-test"
    assert run.config == CONFIG
    assert_rows_hold(rows, jsonl_by_step(offline), "wandb")  # strings and booleans too
    assert math.isnan(rows[2]["loss"]) and rows[2]["grad_norm"] == math.inf and rows[2]["low"] == -math.inf


def test_trackio_local_run_holds_every_record(offline, capsys):
    pytest.importorskip("trackio")
    project = f"posttrain-test-{offline.parent.name}"  # a project of its own in the shared test store
    log_run(offline, "trackio", project)
    assert capsys.readouterr().out == ""  # trackio's announcements go to stderr: stdout is the run directory's
    run, rows = trackio_run(project, offline.name)
    assert {k: v for k, v in run.config.items() if not k.startswith("_")} == CONFIG
    assert_rows_hold(
        {step: {k: v for k, v in row.items() if k != "timestamp"} for step, row in rows.items()},
        jsonl_by_step(offline),
        "trackio",
    )


def test_mlflow_file_store_run_holds_the_numbers_and_the_config(offline):
    pytest.importorskip("mlflow")
    log_run(offline, "mlflow", "posttrain-test")
    run, client = mlflow_run(f"file:{offline / 'mlruns'}", "posttrain-test", offline.name)
    assert run.info.status == "FINISHED"
    # Every int and float, at its step; strings and booleans have no place among MLflow's metrics.
    assert mlflow_numbers(client, run) == jsonl_numbers(offline)
    params = run.data.params
    leaves = dotted(CONFIG)
    assert set(params) == set(leaves)
    for key, value in leaves.items():
        assert params[key] == (value if isinstance(value, str) else json.dumps(value)), key


def test_trackio_writes_to_the_suites_temporary_store():
    """Not to HF_HOME/trackio: there, an earlier run of the suite leaves runs under the same project and run
    names, and every read-back above finds two. `import trl` imports trackio, so this holds only because the
    root conftest sets the store before any test module loads."""
    pytest.importorskip("trackio")
    store = trackio_dir()
    assert store.name.startswith("posttrain-test-trackio-"), store
    assert store.parent == Path(tempfile.gettempdir()), store

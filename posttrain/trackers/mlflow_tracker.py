"""MLflow: one MLflow run in the experiment `log.project`, at MLflow's own tracking URI
(`MLFLOW_TRACKING_URI`: a server, `file:<dir>` or `sqlite:///<file>`; unset, MLflow's default).

The config goes in as parameters with dotted names (`optim.lr`), the metrics as metrics with their step.
It talks to the store through an `MlflowClient` of its own, so no MLflow "active run" is left behind in
the process (a second run in the same process starts clean)."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from posttrain.trackers.base import Metrics, flat_params, import_library, numbers
from posttrain.trackers.registry import register

# MLflow refuses names with other characters, names a path normalization would change (`a//b`, `/a`, `a/./b`),
# names over 250 characters and parameter values over 6000. Metric names take a reward function's name
# (`reward/<file.py:fn>/mean`, the file given as a path) and config keys a user's mapping keys.
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
_MAX_NAME = 250
_MAX_PARAM_VALUE = 6000


def mlflow_name(key: str, file_store: bool = False) -> str:
    """`key` as a name MLflow accepts: other characters become `_`; empty, `.` and `..` path parts are dropped
    (`reward//tmp/r.py:f/mean` -> `reward/tmp/r.py:f/mean`). Names it already accepts stay as they are.

    A file store keeps each metric in a file named after it, so `loss` and `loss/policy` cannot both be
    there (`loss` would be a file and a directory): for it every `/` becomes `.` (`loss.policy`)."""
    parts = [part for part in _BAD_NAME_CHARS.sub("_", key).split("/") if part not in ("", ".", "..")]
    return (("." if file_store else "/").join(parts) or "_")[:_MAX_NAME]


def _is_file_store(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a bare path (a Windows drive letter reads as a scheme)


@register
class MlflowTracker:
    name = "mlflow"  # also its package and its posttrain extra

    def __init__(self, project: str) -> None:
        self.project = project
        self._client: Any = None
        self._run_id: str | None = None
        self._entities: Any = None
        self._file_store = False

    def open(self, run_name: str, config: Mapping[str, Any], run_dir: Path) -> None:
        tracking = import_library(self, "mlflow.tracking")
        self._entities = import_library(self, "mlflow.entities")
        uri = tracking.get_tracking_uri()  # MLFLOW_TRACKING_URI, or MLflow's default
        client = tracking.MlflowClient(tracking_uri=uri)
        self._file_store = _is_file_store(uri)
        experiment = client.get_experiment_by_name(self.project)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(self.project)
        run = client.create_run(experiment_id, run_name=run_name)
        self._client, self._run_id = client, run.info.run_id
        params = [
            self._entities.Param(mlflow_name(key, self._file_store), value[:_MAX_PARAM_VALUE])
            for key, value in flat_params(config).items()
        ]
        client.log_batch(self._run_id, params=params)  # the client sends them in batches of MLflow's limit

    def log(self, metrics: Metrics, step: int) -> None:
        now_ms = int(time.time() * 1000)
        batch = [
            self._entities.Metric(mlflow_name(key, self._file_store), value, now_ms, step)
            for key, value in numbers(metrics)
        ]
        if batch:
            self._client.log_batch(self._run_id, metrics=batch)

    def close(self) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id)
        self._client = self._run_id = None

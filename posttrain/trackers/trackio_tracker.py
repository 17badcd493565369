"""Trackio: local-first; runs go to Trackio's own store (`TRACKIO_DIR`, by default in the Hugging Face cache),
where `trackio show --project posttrain` finds every run of the project."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.trackers.base import Metrics, import_library
from posttrain.trackers.registry import register


@register
class TrackioTracker:
    name = "trackio"  # also its package and its posttrain extra

    def __init__(self, project: str) -> None:
        self.project = project
        self._trackio: Any = None
        self._run: Any = None

    def open(self, run_name: str, config: Mapping[str, Any], run_dir: Path) -> None:
        self._trackio = trackio = import_library(self, "trackio")
        # No notebook embedding, and no system metrics of its own: the run logs what metrics.jsonl gets. Trackio
        # announces itself on stdout, where the commands print only the run directory: its lines go to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            self._run = trackio.init(
                project=self.project,
                name=run_name,
                config=dict(config),
                embed=False,
                auto_log_gpu=False,
                auto_log_cpu=False,
            )

    def log(self, metrics: Metrics, step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            # trackio.finish(), not run.finish(): it also lets go of the run as the current one, which trackio
            # would otherwise finish (and announce) a second time at exit.
            with contextlib.redirect_stdout(sys.stderr):
                self._trackio.finish()
            self._run = None

"""Weights & Biases: one W&B run per process, its files under `<run>/wandb/`.

W&B's own settings apply: `WANDB_MODE=offline` keeps the run on disk (`wandb sync <run>/wandb/offline-run-*`
uploads it later), `WANDB_API_KEY` / `wandb login` for the server, `WANDB_ENTITY` for the team."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.trackers.base import Metrics, import_library
from posttrain.trackers.registry import register


@register
class WandbTracker:
    name = "wandb"  # also its package and its posttrain extra

    def __init__(self, project: str) -> None:
        self.project = project
        self._run: Any = None

    def open(self, run_name: str, config: Mapping[str, Any], run_dir: Path) -> None:
        wandb = import_library(self, "wandb")
        # dir=: W&B writes `<dir>/wandb/`; the run directory keeps it with the run's other files.
        self._run = wandb.init(project=self.project, name=run_name, config=dict(config), dir=str(run_dir))

    def log(self, metrics: Metrics, step: int) -> None:
        # Every value, strings and booleans too: a W&B history row holds any JSON value. Two records with one
        # step (the RL loop's last step and its final evaluation) merge into that step's row.
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

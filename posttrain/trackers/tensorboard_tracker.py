"""TensorBoard: event files in `<run>/tensorboard/` (`tensorboard --logdir runs/`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.trackers.base import Metrics, import_library, numbers
from posttrain.trackers.registry import register

TENSORBOARD_DIR = "tensorboard"


@register
class TensorBoardTracker:
    name = "tensorboard"  # also its package and its posttrain extra

    def __init__(self, project: str) -> None:
        self._writer: Any = None  # the run directory names the run; TensorBoard has no project

    def open(self, run_name: str, config: Mapping[str, Any], run_dir: Path) -> None:
        module = import_library(self, "torch.utils.tensorboard")
        self._writer = module.SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def log(self, metrics: Metrics, step: int) -> None:
        for key, value in numbers(metrics):  # scalars only: strings and booleans stay in metrics.jsonl
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

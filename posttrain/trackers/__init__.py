"""Experiment trackers that a run's metrics go to besides `metrics.jsonl` (`log.report_to`).

Each adapter is a small class in its own module, registered by name in `TRACKERS`; `posttrain.metrics`
opens the chosen ones and sends each of them every record it writes (see docs/tracking.md).
"""

from posttrain.trackers.base import Tracker
from posttrain.trackers.registry import (
    TRACKERS,
    check_installed,
    close_all,
    open_trackers,
    register,
    resolve_report_to,
)

# Importing the adapters registers them, in the order `log.report_to`'s error message lists them.
from posttrain.trackers import tensorboard_tracker, wandb_tracker, trackio_tracker, mlflow_tracker  # noqa: E402,F401 isort:skip

__all__ = ["TRACKERS", "Tracker", "check_installed", "close_all", "open_trackers", "register", "resolve_report_to"]

"""Run reports (`posttrain report RUN_DIR`): plots and an HTML page from a run's metrics.jsonl."""

from posttrain.report.html import render_report
from posttrain.report.load import RunData, load_run

__all__ = ["RunData", "load_run", "render_report"]

"""`posttrain report RUN_DIR [--out DIR]`: render a run's metrics as report.html + plots/*.png (docs/report.md)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holding metrics.jsonl)")
    parser.add_argument(
        "--out",
        default=None,
        help="write report.html and plots/ here instead of into RUN_DIR (e.g. for a read-only run)",
    )


def run(args: argparse.Namespace) -> int:
    from posttrain.report import render_report  # matplotlib loads only when a report is made

    print(render_report(args.run_dir, args.out))
    return 0

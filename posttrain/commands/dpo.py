"""`posttrain dpo [CONFIG.yaml] [key=value ...]`: DPO-family preference optimisation (see docs/dpo.md)."""

from __future__ import annotations

import argparse
import logging

from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="[CONFIG.yaml] [key=value ...]",
        help="an optional YAML config, then overrides such as data.path=pairs.jsonl --train.max_steps 20",
    )


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.dpo import DPOConfig, train_dpo

    cfg = parse_cli_config(DPOConfig, args.argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("posttrain")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        run_dir = train_dpo(cfg)
    finally:
        package_logger.removeHandler(handler)
    print(run_dir)
    return 0

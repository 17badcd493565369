"""`posttrain rm [CONFIG.yaml] [key=value ...]`: reward-model training (Bradley-Terry, scalar head)."""

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
    from posttrain.trainers.reward_model import RMConfig, train_reward_model

    cfg = parse_cli_config(RMConfig, args.argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("posttrain")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        run_dir = train_reward_model(cfg)
    finally:
        package_logger.removeHandler(handler)
    print(run_dir)
    return 0

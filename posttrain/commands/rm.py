"""`posttrain rm [CONFIG.yaml] [key=value ...]`: reward-model training (Bradley-Terry, scalar head)."""

from __future__ import annotations

import argparse

from posttrain.commands.common import add_config_arguments, run_logged
from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "data.path=pairs.jsonl --train.max_steps 20", distributed=True)


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.reward_model import RMConfig, train_reward_model

    return run_logged(train_reward_model, parse_cli_config(RMConfig, args.argv))

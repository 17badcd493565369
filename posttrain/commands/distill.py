"""`posttrain distill [CONFIG.yaml] [key=value ...]`: teacher -> student distillation (forward / reverse KL, JSD)."""

from __future__ import annotations

import argparse

from posttrain.commands.common import add_config_arguments, run_logged
from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "data.path=pairs.jsonl --train.max_steps 20", distributed=True)


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.distill import DistillConfig, train_distill

    return run_logged(train_distill, parse_cli_config(DistillConfig, args.argv))

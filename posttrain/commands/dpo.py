"""`posttrain dpo [CONFIG.yaml] [key=value ...]`: DPO-family preference optimisation (see docs/dpo.md)."""

from __future__ import annotations

import argparse

from posttrain.commands.common import add_config_arguments, run_logged
from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "data.path=pairs.jsonl --train.max_steps 20", distributed=True)


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.preference.dpo import DPOConfig, train_dpo

    return run_logged(train_dpo, parse_cli_config(DPOConfig, args.argv))

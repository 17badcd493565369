"""`posttrain sft [CONFIG.yaml] [key=value ...]`: supervised fine-tuning (see docs/sft.md)."""

from __future__ import annotations

import argparse

from posttrain.commands.common import add_config_arguments, run_logged
from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "data.path=train.jsonl optim.lr=1e-5 --train.max_steps 20", distributed=True)


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.sft import SFTConfig, train_sft

    return run_logged(train_sft, parse_cli_config(SFTConfig, args.argv))

"""`posttrain grpo [CONFIG.yaml] [key=value ...]`: the GRPO family (grpo, dr_grpo, dapo, gspo, rloo,
reinforce_pp) on the rollout engine over the live policy. With no arguments: the default model learns
two-digit addition, with held-out greedy accuracy reported before and after."""

from __future__ import annotations

import argparse

from posttrain.commands.common import add_config_arguments
from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "algorithm=dapo optim.lr=2e-5", distributed=True)


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.rl import train_grpo
    from posttrain.trainers.rl.config import GRPOConfig

    train_grpo(parse_cli_config(GRPOConfig, args.argv))
    return 0

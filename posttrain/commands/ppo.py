"""`posttrain ppo [CONFIG.yaml] [key=value ...]`: PPO with GAE and a value head on the policy trunk,
on the rollout engine over the live policy."""

from __future__ import annotations

import argparse

from posttrain.commands.common import add_config_arguments
from posttrain.config import parse_cli_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "ppo.lam=0.95 optim.lr=1e-5", distributed=True)


def run(args: argparse.Namespace) -> int:
    from posttrain.trainers.rl import train_ppo
    from posttrain.trainers.rl.config import PPOConfig

    train_ppo(parse_cli_config(PPOConfig, args.argv))
    return 0

"""The old import path of the RL configs (docs before the trainers/rl/ package): now `posttrain.trainers.rl`."""

from posttrain.trainers.rl.config import GRPOConfig, PPOConfig

__all__ = ["GRPOConfig", "PPOConfig"]

"""The old import path of `train_ppo` (docs before the trainers/rl/ package): now `posttrain.trainers.rl`."""

from posttrain.trainers.rl.train import train_ppo

__all__ = ["train_ppo"]

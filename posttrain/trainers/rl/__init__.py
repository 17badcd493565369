"""The RL trainers (`posttrain grpo`, `posttrain ppo`): the GRPO family and PPO on the shared-weight engine.

config     typed sections, GRPOConfig / PPOConfig, the algorithm presets, validation
run        `setup_run`: model, engine, optimizer, reference, value head, checkpoints
step       `rl_step`: rollout, scoring passes, advantages, update
update     the passes and the policy update (the pure objective is `posttrain.algos.objective`)
batch      groups packed one row each, the prompt computed once
zero_advantage   groups without signal left out of the update
ppo        the value head and GAE
metrics    timing, memory, batch statistics
train      the loop: `train`, `train_grpo`, `train_ppo`
"""

from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from posttrain.trainers.rl.run import RLRun, setup_run
from posttrain.trainers.rl.step import rl_step
from posttrain.trainers.rl.train import train_grpo, train_ppo

# `train` (the loop both entry points run) stays `posttrain.trainers.rl.train.train`: exported here, the
# function would shadow its own module's name on the package.
__all__ = ["GRPOConfig", "PPOConfig", "RLRun", "rl_step", "setup_run", "train_grpo", "train_ppo"]

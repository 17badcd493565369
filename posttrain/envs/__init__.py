"""Environments and tools for agentic RL: what the model talks to between its turns.

Beside `rewards`, below `rollout`; it imports no trainer, engine or rollout module. An episode is a
conversation: the environment opens it (`reset`), reads each parsed model turn and answers with observation
messages (`step`), and may score the whole episode at its end (`episode_reward`).

- `environment`: the `Environment` protocol, `EnvStep` and the chat `Message` type.
- `turns`: `ToolCall` and `ParsedTurn`, a model turn after tool-call parsing.
"""

from posttrain.envs.environment import Environment, EnvStep, Message
from posttrain.envs.turns import ParsedTurn, ToolCall

__all__ = ["EnvStep", "Environment", "Message", "ParsedTurn", "ToolCall"]

"""Environments and tools for agentic RL: what the model talks to between its turns.

Beside `rewards`, below `rollout`; it imports no trainer, engine or rollout module. An episode is a
conversation: the environment opens it (`reset`), reads each parsed model turn and answers with observation
messages (`step`), and may score the whole episode at its end (`episode_reward`).

- `environment`: the `Environment` protocol, `EnvStep` and the chat `Message` type.
- `turns`: `ToolCall` and `ParsedTurn`, a model turn after tool-call parsing.
- `tools`: `Tool` / `as_tool` (schema from a function's signature) and `run_tool_call` (errors as observations).
- `builtin_tools`: `calculator` (exact arithmetic, no eval), `calculate` (one operation per call), `python`.
- `tool_calls`: tool-call parsers by name (`hermes`, for the `chatml_tools` template) or `file.py:function`.
- `tool_env`: `ToolEnvironment`, the generic one (tools until a turn without a call).
- `trl_adapter`: TRL's `environment_factory` classes, run unchanged (`TRLEnvironment`).
- `calculator`, `guess_number`, `word_problems`: the built-in environments; `guess_number_tools`: the game as a TRL
  environment_factory class (each guess a tool call); `transcripts`: their SFT transcripts.
- `loading`: `load_environment_factory(name, tools, options)`, built-ins or `file.py:Class` / `module:Class`.
"""

from posttrain.envs.environment import EnvError, Environment, EnvStep, Message
from posttrain.envs.loading import BUILTIN_ENVIRONMENTS, load_environment_factory, load_tools
from posttrain.envs.tool_calls import TOOL_CALL_PARSERS, get_tool_call_parser, register_tool_call_parser
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import Tool, ToolError, as_tool, as_tools, run_tool_call
from posttrain.envs.trl_adapter import TRLEnvironment
from posttrain.envs.turns import ParsedTurn, ToolCall

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "TOOL_CALL_PARSERS",
    "EnvError",
    "TRLEnvironment",
    "ToolEnvironment",
    "load_environment_factory",
    "load_tools",
    "EnvStep",
    "Environment",
    "Message",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolError",
    "as_tool",
    "as_tools",
    "get_tool_call_parser",
    "register_tool_call_parser",
    "run_tool_call",
]

"""Environments and tools for agentic RL: what the model talks to between its turns.

Beside `rewards`, below `rollout`; it imports no trainer, engine or rollout module. An episode is a
conversation: the environment opens it (`reset`), reads each parsed model turn and answers with observation
messages (`step`), and may score the whole episode at its end (`episode_reward`).

- `environment`: the `Environment` protocol, `EnvStep` and the chat `Message` type.
- `turns`: `ToolCall` and `ParsedTurn`, a model turn after tool-call parsing.
- `tools`: `Tool` / `as_tool` (schema from a function's signature) and `run_tool_call` (errors as observations).
- `builtin_tools`: `calculator` (exact arithmetic, no eval) and `python` (the reward sandbox).
- `tool_calls`: tool-call parsers by name (`hermes`, for the `chatml_tools` template) or `file.py:function`.
"""

from posttrain.envs.environment import Environment, EnvStep, Message
from posttrain.envs.tool_calls import TOOL_CALL_PARSERS, get_tool_call_parser, register_tool_call_parser
from posttrain.envs.tools import Tool, ToolError, as_tool, as_tools, run_tool_call
from posttrain.envs.turns import ParsedTurn, ToolCall

__all__ = [
    "TOOL_CALL_PARSERS",
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

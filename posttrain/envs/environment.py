"""The environment interface every agentic rollout drives, and what one step returns.

An environment serves one episode at a time (the rollout makes one per episode from a factory):

    messages = env.reset(row)          # the opening messages: system / user, from the dataset row
    step = env.step(parsed_turn)       # after each model turn: observations (tool results, feedback)
    ...                                # until step.done, or a limit of the rollout (turns, tokens)
    env.episode_reward()               # the outcome reward, or None to score with the run's reward functions

`tools` are the functions the model may call; their schemas are rendered into the prompt through the chat
template's `tools=` argument. Environments run in worker threads, one call at a time per episode: `step`
may block (tools, a subprocess), and may be slow, but must not share mutable state between episodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.envs.turns import ParsedTurn
from posttrain.errors import PosttrainError

Message = dict[str, Any]  # a chat message: {"role", "content"} (+ "tool_calls", "tool_call_id", "name")


class EnvError(PosttrainError):
    """An environment, option or row that cannot be used; the message names the class / option / column."""


@dataclass
class EnvStep:
    """What the environment answers to one model turn.

    `observations` are appended to the conversation after the model's turn (role "tool" for tool results,
    "user" for feedback); `reward` is an optional per-turn reward; `done` ends the episode. `counts` are the
    step's event counts the rollout sums into its metrics, e.g. {"tool_calls": 2, "tool_calls/calculator": 2,
    "tool_errors": 1, "tool_timeouts": 0, "parse_failures": 0}."""

    observations: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    counts: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    tools: list[Any]  # posttrain.envs tools: each has `.name` and `.schema` (OpenAI function format)

    def reset(self, row: Mapping[str, Any]) -> list[Message]: ...

    def step(self, turn: ParsedTurn) -> EnvStep: ...

    def episode_reward(self) -> float | None: ...

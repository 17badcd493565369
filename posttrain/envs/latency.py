"""`env.tool_latency_s`: make any environment answer as slowly as a remote tool, sandbox or judge would.

    make_env = with_latency(make_env, 0.5)   # every step that answers the model waits 0.5 s first

The wait is a sleep in the environment's worker thread: it uses no CPU, so a rollout that keeps decoding other
episodes meanwhile (and async training, which keeps updating) can hide it, while a rollout that waits on it
cannot. One wait per answered turn: the calls of one turn run concurrently, as a remote service would serve
them. A step that only ends the episode (a final answer, nothing to observe) does not wait. Each wait is counted
as `latency_waits` in the step's counts (the rollout sums them into `env/latency_waits`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.envs.environment import EnvError, Environment, EnvStep, Message
from posttrain.envs.turns import ParsedTurn


class DelayedEnvironment:
    """`inner`, with `latency_s` of sleep before each step that returns observations."""

    def __init__(self, inner: Environment, latency_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.tools = inner.tools
        self.latency_s = latency_s
        self.sleep = sleep

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        return self.inner.reset(row)

    def step(self, turn: ParsedTurn) -> EnvStep:
        step = self.inner.step(turn)
        if step.observations:
            self.sleep(self.latency_s)
            step.counts = {**step.counts, "latency_waits": step.counts.get("latency_waits", 0.0) + 1.0}
        return step

    def episode_reward(self) -> float | None:
        return self.inner.episode_reward()


def with_latency(make_env: Callable[[], Environment], latency_s: float) -> Callable[[], Environment]:
    """A factory of `make_env`'s environments that wait `latency_s` per answered turn (0: `make_env` itself)."""
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not latency_s >= 0:
        raise EnvError(f"tool_latency_s must be a number >= 0, got {latency_s!r}")
    if latency_s == 0:
        return make_env

    def make() -> Environment:
        return DelayedEnvironment(make_env(), float(latency_s))

    return make

"""What the RL trainer expects of a task, and small helpers every task shares."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from posttrain.errors import PosttrainError


class TaskError(PosttrainError):
    """A task option, data file or saved task state that cannot be used (names the file / key / value)."""


class Task(Protocol):
    """A source of RL prompts with reference answers.

    Rows are dicts with a "prompt" (chat messages) and the columns the task's reward reads (e.g. "answer").
    `reward` is a `posttrain.rewards.load_reward` spec. `sample` advances the task; `state_dict` /
    `load_state_dict` save and restore that position exactly (plain ints, JSON-friendly).
    """

    name: str
    reward: str

    def sample(self, n: int) -> list[dict[str, Any]]: ...

    def held_out(self, n: int = 200) -> list[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_count(n: Any, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TaskError(f"{what}: n must be a non-negative integer, got {n!r}")


def check_state(state: Any, keys: Iterable[str], what: str) -> None:
    """A saved state must be a dict with exactly `keys`, each a non-negative int."""
    keys = tuple(keys)
    if not isinstance(state, dict):
        raise TaskError(f"{what}: state must be a dict, got {type(state).__name__}")
    missing = [key for key in keys if key not in state]
    unknown = sorted(set(state) - set(keys))
    if missing or unknown:
        raise TaskError(
            f"{what}: state keys must be {', '.join(keys)} "
            f"(missing: {', '.join(missing) or '-'}; unknown: {', '.join(unknown) or '-'})"
        )
    for key in keys:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or (key != "seed" and value < 0):
            raise TaskError(f"{what}: state[{key!r}] must be a non-negative integer, got {value!r}")


def accuracy(rewards: Sequence[float | None], threshold: float = 1.0) -> float:
    """Fraction of scorable samples whose reward is >= threshold (1.0: full credit on 0/1 rewards).

    None / NaN rewards (unscorable: e.g. a missing reference) are left out of the denominator; a list
    with no scorable reward raises ValueError rather than reporting a made-up number.
    """
    scored = [float(r) for r in rewards if r is not None and not math.isnan(float(r))]
    if not scored:
        raise ValueError(f"accuracy: no scorable rewards among {len(rewards)}")
    return sum(r >= threshold for r in scored) / len(scored)

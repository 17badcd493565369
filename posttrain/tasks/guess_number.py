"""Rows for the `guess_number` environment: a secret number in [low, high], drawn from a seed.

`{"prompt": [{"role": "user", "content": "I am thinking of a number between 1 and 100. ..."}], "secret": 37,
"low": 1, "high": 100}`. The environment scores the game itself (posttrain.envs.guess_number); there is no
reference answer column. Held-out games draw from their own seed stream.
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.tasks.base import TaskError, check_count, check_state

PROMPT = (
    "I am thinking of a number between {low} and {high}. Guess it: reply with one number each turn, "
    "and I will tell you whether the secret is higher or lower."
)


def make_row(secret: int, low: int, high: int) -> dict[str, Any]:
    content = PROMPT.format(low=low, high=high)
    return {"prompt": [{"role": "user", "content": content}], "secret": secret, "low": low, "high": high}


class GuessNumberTask:
    """Secret numbers drawn uniformly from [low, high]; `held_out(n, seed)` from a separate stream."""

    name = "guess_number"
    reward = ""  # scored by the environment (episode_reward), not by a reward function

    def __init__(self, seed: int = 0, low: int = 1, high: int = 100) -> None:
        for key, value in (("seed", seed), ("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TaskError(f"guess_number task: {key} must be an integer, got {value!r}")
        if low >= high:
            raise TaskError(f"guess_number task: low ({low}) must be below high ({high})")
        self.seed, self.low, self.high = seed, low, high
        self.calls = 0

    def sample(self, n: int) -> list[dict[str, Any]]:
        check_count(n, "guess_number task: sample(n)")
        rng = random.Random(f"guess_number:{self.seed}:{self.calls}")
        self.calls += 1
        return [make_row(rng.randint(self.low, self.high), self.low, self.high) for _ in range(n)]

    def held_out(self, n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
        check_count(n, "guess_number task: held_out(n)")
        rng = random.Random(f"guess_number-held-out:{seed}")
        return [make_row(rng.randint(self.low, self.high), self.low, self.high) for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("seed", "calls"), "guess_number task")
        self.seed, self.calls = state["seed"], state["calls"]

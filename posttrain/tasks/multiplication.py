"""The agentic demo's task: a 3-digit number times a 2-digit number, asked in plain words.

Rows are `{"prompt": [{"role": "user", "content": "What is 347 times 29?"}], "answer": "10063"}`, scored by
`numeric_match` (the final answer's last number against the exact product). The default 135M model gets
these wrong alone; with the `calculator` tool (the `calculator` environment) it can get them right.

Held-out problems are a fixed part of the problem space, as in the arithmetic task: an ordered pair (a, b)
is held out when a hash of it falls in one bucket of ten, and `sample` never draws those pairs. `held_out(n,
seed)` draws from them with its own seed, so training and evaluation never share a problem. Call k of
`sample` draws from a generator seeded by (seed, k) alone: `state_dict()` is those two numbers.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from posttrain.tasks.base import TaskError, check_count, check_state

TEMPLATES = (
    "What is {a} times {b}?",
    "Multiply {a} by {b}.",
    "Compute the product of {a} and {b}.",
    "What do you get when you multiply {a} by {b}?",
    "Find {a} multiplied by {b}.",
)
LEFT = range(100, 1000)  # 3-digit
RIGHT = range(10, 100)  # 2-digit
HELD_OUT_BUCKETS = 10


def is_held_out_pair(a: int, b: int) -> bool:
    """Whether a x b belongs to the held-out part of the problem space."""
    digest = hashlib.sha256(f"multiplication:{a}*{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_BUCKETS == 0


def make_row(a: int, b: int, template: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": template.format(a=a, b=b)}], "answer": str(a * b)}


_ALL_PAIRS = [(a, b) for a in LEFT for b in RIGHT]
TRAIN_PAIRS = tuple(pair for pair in _ALL_PAIRS if not is_held_out_pair(*pair))
HELD_OUT_PAIRS = tuple(pair for pair in _ALL_PAIRS if is_held_out_pair(*pair))


class MultiplicationTask:
    """Fresh 3-digit x 2-digit products on every `sample` call; a fixed disjoint `held_out` set."""

    name = "multiplication"
    reward = "numeric_match"

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TaskError(f"multiplication task: seed must be an integer, got {seed!r}")
        self.seed = seed
        self.calls = 0

    def sample(self, n: int) -> list[dict[str, Any]]:
        """n new training problems (pairs and phrasings drawn with replacement)."""
        check_count(n, "multiplication task: sample(n)")
        rng = random.Random(f"multiplication:{self.seed}:{self.calls}")
        self.calls += 1
        return [make_row(*rng.choice(TRAIN_PAIRS), rng.choice(TEMPLATES)) for _ in range(n)]

    def held_out(self, n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
        """n distinct held-out problems; the same n and seed give the same rows (independent of `sample`)."""
        check_count(n, "multiplication task: held_out(n)")
        if n > len(HELD_OUT_PAIRS):
            raise TaskError(f"multiplication task: held_out(n={n}) but only {len(HELD_OUT_PAIRS)} pairs are held out")
        rng = random.Random(f"multiplication-held-out:{seed}")
        return [make_row(a, b, rng.choice(TEMPLATES)) for a, b in rng.sample(HELD_OUT_PAIRS, n)]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("seed", "calls"), "multiplication task")
        self.seed, self.calls = state["seed"], state["calls"]

"""The demo's built-in task: the sum of two 2-digit numbers, asked in plain words.

Rows are `{"prompt": [{"role": "user", "content": "What is 47 plus 38? Answer with just the number."}],
"answer": "85"}`, scored by `numeric_match`. Prompts stay short (the default model is a 135M chat model
with a ~32-token completion budget).

Held-out problems are a fixed part of the problem space: an unordered pair {a, b} is held out when a
hash of it falls in one bucket of ten, and training draws never use those pairs in either order. So a
held-out set is disjoint from everything `sample` can return, for any seed.

Determinism: call k of `sample` draws from a generator seeded by (seed, k) alone, so the stream is fixed
by the seed and the call count — `state_dict()` is just those two numbers and restores it exactly.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from posttrain.tasks.base import TaskError, check_count, check_state

TEMPLATES = (
    "What is {a} plus {b}? Answer with just the number.",
    "Add {a} and {b}. Reply with only the final number.",
    "Compute the sum of {a} and {b}. Give only the number.",
    "What is {a} + {b}? Reply with the number only.",
    "Find the sum of {a} and {b}. Answer with a single number.",
)
OPERANDS = range(10, 100)
HELD_OUT_BUCKETS = 10  # 1 in 10 unordered pairs is held out


def is_held_out_pair(a: int, b: int) -> bool:
    """Whether {a, b} (in either order) belongs to the held-out part of the problem space."""
    low, high = sorted((a, b))
    digest = hashlib.sha256(f"arithmetic:{low}+{high}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_BUCKETS == 0


def make_row(a: int, b: int, template: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": template.format(a=a, b=b)}], "answer": str(a + b)}


_ALL_PAIRS = [(a, b) for a in OPERANDS for b in OPERANDS]
TRAIN_PAIRS = tuple(pair for pair in _ALL_PAIRS if not is_held_out_pair(*pair))
HELD_OUT_PAIRS = tuple(pair for pair in _ALL_PAIRS if is_held_out_pair(*pair))


class ArithmeticTask:
    """Fresh two-digit addition problems on every `sample` call; a fixed disjoint `held_out` set."""

    name = "arithmetic"
    reward = "numeric_match"

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TaskError(f"arithmetic task: seed must be an integer, got {seed!r}")
        self.seed = seed
        self.calls = 0  # how many times `sample` has run

    def sample(self, n: int) -> list[dict[str, Any]]:
        """n new training problems (pairs and phrasings drawn with replacement)."""
        check_count(n, "arithmetic task: sample(n)")
        rng = random.Random(f"arithmetic:{self.seed}:{self.calls}")
        self.calls += 1
        return [make_row(*rng.choice(TRAIN_PAIRS), rng.choice(TEMPLATES)) for _ in range(n)]

    def held_out(self, n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
        """n distinct held-out problems; the same n and seed give the same rows (independent of `sample`)."""
        check_count(n, "arithmetic task: held_out(n)")
        if n > len(HELD_OUT_PAIRS):
            raise TaskError(f"arithmetic task: held_out(n={n}) but only {len(HELD_OUT_PAIRS)} held-out pairs exist")
        rng = random.Random(f"arithmetic-held-out:{seed}")
        return [make_row(a, b, rng.choice(TEMPLATES)) for a, b in rng.sample(HELD_OUT_PAIRS, n)]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("seed", "calls"), "arithmetic task")
        self.seed, self.calls = state["seed"], state["calls"]

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

from typing import Any

from posttrain.tasks.operand_pairs import OperandPairs, OperandPairTask, in_held_out_bucket, split_pairs

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
    return in_held_out_bucket(f"arithmetic:{low}+{high}", HELD_OUT_BUCKETS)


def make_row(a: int, b: int, template: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": template.format(a=a, b=b)}], "answer": str(a + b)}


TRAIN_PAIRS, HELD_OUT_PAIRS = split_pairs(((a, b) for a in OPERANDS for b in OPERANDS), is_held_out_pair)


class ArithmeticTask(OperandPairTask):
    """Fresh two-digit addition problems on every `sample` call; a fixed disjoint `held_out` set."""

    name = "arithmetic"
    reward = "numeric_match"
    problems = OperandPairs(TEMPLATES, TRAIN_PAIRS, HELD_OUT_PAIRS, make_row)

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

from typing import Any

from posttrain.tasks.operand_pairs import OperandPairs, OperandPairTask, in_held_out_bucket, split_pairs

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
    return in_held_out_bucket(f"multiplication:{a}*{b}", HELD_OUT_BUCKETS)


def make_row(a: int, b: int, template: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": template.format(a=a, b=b)}], "answer": str(a * b)}


TRAIN_PAIRS, HELD_OUT_PAIRS = split_pairs(((a, b) for a in LEFT for b in RIGHT), is_held_out_pair)


class MultiplicationTask(OperandPairTask):
    """Fresh 3-digit x 2-digit products on every `sample` call; a fixed disjoint `held_out` set."""

    name = "multiplication"
    reward = "numeric_match"
    problems = OperandPairs(TEMPLATES, TRAIN_PAIRS, HELD_OUT_PAIRS, make_row)

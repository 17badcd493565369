"""Word problems that need 2-4 chained calculator steps, each on the previous step's result.

    "A library has 347 books. Then it buys 29 more books. Then it splits them into 4 equal parts and keeps one
     part. How many books does it have now?"                                   answer: "94", operations: 2

A problem is a start value and 2-4 operations (add, subtract, multiply by a small factor, divide exactly), each
applied to the running value; only the last value is asked for. With the `word_problems` environment's
one-operation calculator (posttrain.envs.word_problems), each operation is one tool call whose result the
model must carry into the next call: a multi-turn task where the environment's answers decide what comes next.

Rows: `{"prompt": [{"role": "user", "content": ...}], "answer": "94", "operations": 2, "chain": [["+", 29],
["/", 4]], "start": 347}`, scored by `numeric_match` (or the environment's exact-answer reward).

The problem space is split by a hash of the problem's numbers (one bucket of ten held out); `sample` rejects
held-out problems and `held_out(n, seed)` accepts only them, from its own seed stream, so training and
evaluation never share a problem. Call k of `sample` draws from a generator seeded by (seed, k) alone.
"""

from __future__ import annotations

import math
import random
from typing import Any

from posttrain.tasks.base import TaskError, check_count, check_state
from posttrain.tasks.operand_pairs import in_held_out_bucket

HELD_OUT_BUCKETS = 10
MIN_OPERATIONS, MAX_OPERATIONS = 2, 4
START = range(100, 1000)
ADDEND = range(100, 1000)  # added or subtracted: 3-digit
FACTOR = range(3, 20)  # multiplied by
DIVISOR = range(3, 10)  # divided by, exactly
MAX_VALUE = 10**6  # a multiplication that would pass this is drawn again as another operation

OWNERS = ("A shop", "A library", "A school", "A farm", "A warehouse", "A club", "A bakery", "A museum")
ITEMS = ("books", "apples", "coins", "stamps", "cards", "marbles", "tickets", "boxes")
OPENING = "{owner} has {start} {items}."
PHRASES: dict[str, tuple[str, ...]] = {
    "+": ("Then it buys {n} more {items}.", "Then {n} more {items} arrive.", "Then it gets {n} more."),
    "-": ("Then it sells {n} {items}.", "Then {n} {items} are given away.", "Then it loses {n} of them."),
    "*": ("Then the number of {items} becomes {n} times as large.", "Then it multiplies its {items} by {n}."),
    "/": (
        "Then it splits them into {n} equal parts and keeps one part.",
        "Then it shares them equally among {n} groups and keeps one share.",
    ),
}
QUESTION = "How many {items} does it have now?"

Chain = list[tuple[str, int]]


def apply(value: int, op: str, n: int) -> int:
    """One operation on the running value (division is exact by construction)."""
    if op == "+":
        return value + n
    if op == "-":
        return value - n
    if op == "*":
        return value * n
    if value % n:
        raise ValueError(f"{value} / {n} is not exact")
    return value // n


def running_values(start: int, chain: Chain) -> list[int]:
    """The value after each operation of the chain, in order (the last is the answer)."""
    values, value = [], start
    for op, n in chain:
        value = apply(value, op, n)
        values.append(value)
    return values


def evaluate(start: int, chain: Chain) -> int:
    return running_values(start, chain)[-1] if chain else start


def draw_operation(rng: random.Random, value: int) -> tuple[str, int]:
    """An operation that keeps the running value a positive integer below MAX_VALUE."""
    while True:
        op = rng.choice("+-*/")
        if op == "+":
            return op, rng.choice(ADDEND)
        if op == "-" and value > ADDEND[0]:
            return op, rng.randrange(ADDEND[0], min(value, ADDEND[-1] + 1))
        if op == "*" and value * FACTOR[-1] < MAX_VALUE:
            return op, rng.choice(FACTOR)
        divisors = [d for d in DIVISOR if value % d == 0]
        if op == "/" and divisors:
            return op, rng.choice(divisors)


def draw_problem(rng: random.Random, weights: list[float] | None = None) -> tuple[int, Chain]:
    """A start value and its chain; `weights` (one per count of operations, 2 to 4): how often each length is
    drawn (None: uniformly)."""
    start = rng.choice(START)
    chain: Chain = []
    value = start
    counts = range(MIN_OPERATIONS, MAX_OPERATIONS + 1)
    length = rng.randint(MIN_OPERATIONS, MAX_OPERATIONS) if weights is None else rng.choices(counts, weights)[0]
    for _ in range(length):
        op, n = draw_operation(rng, value)
        chain.append((op, n))
        value = apply(value, op, n)
    return start, chain


def is_held_out(start: int, chain: Chain) -> bool:
    key = "word_problems:" + str(start) + "".join(f"{op}{n}" for op, n in chain)
    return in_held_out_bucket(key, HELD_OUT_BUCKETS)


def make_row(rng: random.Random, start: int, chain: Chain) -> dict[str, Any]:
    """The problem in words (owner, items and phrasings drawn from `rng`) and its reference columns."""
    owner, items = rng.choice(OWNERS), rng.choice(ITEMS)
    sentences = [OPENING.format(owner=owner, start=start, items=items)]
    sentences += [rng.choice(PHRASES[op]).format(n=n, items=items) for op, n in chain]
    sentences.append(QUESTION.format(items=items))
    return {
        "prompt": [{"role": "user", "content": " ".join(sentences)}],
        "answer": str(evaluate(start, chain)),
        "operations": len(chain),
        "start": start,
        "chain": [[op, n] for op, n in chain],
    }


def draw_rows(rng: random.Random, n: int, held_out: bool, weights: list[float] | None = None) -> list[dict[str, Any]]:
    """n distinct problems from one side of the split (rejection: one draw in ten is held out)."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, tuple[tuple[str, int], ...]]] = set()
    while len(rows) < n:
        start, chain = draw_problem(rng, weights)
        key = (start, tuple(chain))
        if is_held_out(start, chain) == held_out and key not in seen:
            seen.add(key)
            rows.append(make_row(rng, start, chain))
    return rows


def check_weights(weights: Any) -> list[float] | None:
    """`operation_weights` as floats: one non-negative number per count of operations, 2 to 4, not all 0."""
    if weights is None:
        return None
    counts = MAX_OPERATIONS - MIN_OPERATIONS + 1
    if (
        not isinstance(weights, (list, tuple))
        or len(weights) != counts
        or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf for w in weights)
        or not sum(weights) > 0
    ):
        raise TaskError(
            f"word_problems task: operation_weights must be {counts} non-negative numbers (for 2, 3 and 4 "
            f"operations), not all 0, got {weights!r}"
        )
    return [float(w) for w in weights]


class WordProblemsTask:
    """Fresh chained word problems on every `sample` call; a disjoint `held_out` set (see the module docstring).

    `operation_weights` ([w2, w3, w4]) skews the training draws toward longer or shorter chains (a curriculum's
    mix: the cold start's two-step habit is the easiest thing for RL to reinforce); held-out problems are always
    drawn uniformly, so evaluations stay comparable whatever the mix."""

    name = "word_problems"
    reward = "numeric_match"

    def __init__(self, seed: int = 0, operation_weights: list[float] | None = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TaskError(f"word_problems task: seed must be an integer, got {seed!r}")
        self.seed = seed
        self.weights = check_weights(operation_weights)
        self.calls = 0

    def sample(self, n: int) -> list[dict[str, Any]]:
        check_count(n, "word_problems task: sample(n)")
        rng = random.Random(f"word_problems:{self.seed}:{self.calls}")
        self.calls += 1
        return draw_rows(rng, n, held_out=False, weights=self.weights)

    def held_out(self, n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
        """n held-out problems; the same n and seed give the same rows (independent of `sample`)."""
        check_count(n, "word_problems task: held_out(n)")
        return draw_rows(random.Random(f"word_problems-held-out:{seed}"), n, held_out=True)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("seed", "calls"), "word_problems task")
        self.seed, self.calls = state["seed"], state["calls"]

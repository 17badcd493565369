"""Tasks whose problems are two operands in a phrasing (arithmetic, multiplication): what they do with them.

A task's problem space is a fixed set of operand pairs, split once into training and held-out pairs (by a
hash of the pair, in the task's module), so a held-out set is disjoint from everything `sample` can return,
for any seed. Call k of `sample` draws from a generator seeded by (task name, seed, k) alone: the stream is
fixed by the seed and the call count, and `state_dict()` is just those two numbers, which restore it exactly.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.tasks.base import TaskError, check_count, check_state

Pair = tuple[int, int]


def in_held_out_bucket(key: str, buckets: int) -> bool:
    """Whether the problem `key` names is held out: a hash of it falls in one bucket of `buckets`."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % buckets == 0


def split_pairs(
    pairs: Iterable[Pair], is_held_out: Callable[[int, int], bool]
) -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """(training pairs, held-out pairs), each in the order of `pairs`. One hash per pair: the tasks split their
    spaces at import (81,000 pairs for multiplication), which every process that loads the task registry pays."""
    train: list[Pair] = []
    held_out: list[Pair] = []
    for pair in pairs:
        (held_out if is_held_out(*pair) else train).append(pair)
    return tuple(train), tuple(held_out)


@dataclass(frozen=True)
class OperandPairs:
    """A problem space: the phrasings, the training and the held-out operand pairs, and how a row is made
    from a pair and a phrasing."""

    templates: tuple[str, ...]
    train: tuple[Pair, ...]
    held_out: tuple[Pair, ...]
    make_row: Callable[[int, int, str], dict[str, Any]]


class OperandPairTask:
    """Fresh problems on every `sample` call and a fixed disjoint `held_out` set, from the class's `problems`;
    a task names itself (`name`, `reward`) and its `problems`, and takes the rest from here."""

    name: ClassVar[str]
    reward: ClassVar[str]
    problems: ClassVar[OperandPairs]

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TaskError(f"{self.name} task: seed must be an integer, got {seed!r}")
        self.seed = seed
        self.calls = 0  # how many times `sample` has run

    def sample(self, n: int) -> list[dict[str, Any]]:
        """n new training problems (pairs and phrasings drawn with replacement)."""
        check_count(n, f"{self.name} task: sample(n)")
        rng = random.Random(f"{self.name}:{self.seed}:{self.calls}")
        self.calls += 1
        problems = self.problems
        return [problems.make_row(*rng.choice(problems.train), rng.choice(problems.templates)) for _ in range(n)]

    def held_out(self, n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
        """n distinct held-out problems; the same n and seed give the same rows (independent of `sample`)."""
        check_count(n, f"{self.name} task: held_out(n)")
        problems = self.problems
        if n > len(problems.held_out):
            raise TaskError(f"{self.name} task: held_out(n={n}) but only {len(problems.held_out)} held-out pairs exist")
        rng = random.Random(f"{self.name}-held-out:{seed}")
        return [problems.make_row(a, b, rng.choice(problems.templates)) for a, b in rng.sample(problems.held_out, n)]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("seed", "calls"), f"{self.name} task")
        self.seed, self.calls = state["seed"], state["calls"]

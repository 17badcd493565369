"""A against B on a noisy machine: the sides alternate (A B, B A, A B, ...) and the figures are medians.

    from alternation import alternate, ratio_summary
    figures = alternate({"posttrain": run_ours, "trl": run_trl}, rounds=3)   # {"posttrain": [f1, f2, f3], ...}
    result.update(ratio_summary(figures["posttrain"], figures["trl"], higher_is_better=True))

A VM's speed drifts from minute to minute by more than the difference being measured; a ratio from one pair of
runs reads the minute as much as the code. Alternating the order round by round puts each side first as often
as second, and the spread of the per-round ratios says how far one round can be trusted.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable


def round_order(names: list[str], round_index: int) -> list[str]:
    """The sides' order in round `round_index` (0-based): as given in even rounds, reversed in odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def alternate(sides: dict[str, Callable[[], float]], rounds: int, log: bool = True) -> dict[str, list[float]]:
    """Calls each side once per round, in `round_order`; returns each side's figures in round order.

    Each callable measures one side once (its own warm-up excluded inside it) and returns its figure."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    figures: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(rounds):
        for name in round_order(list(sides), index):
            figure = sides[name]()
            figures[name].append(figure)
            if log:
                print(f"round {index + 1}/{rounds} {name}: {figure:.4g}", file=sys.stderr, flush=True)
    return figures


def ratio_summary(ours: list[float], theirs: list[float], higher_is_better: bool = True, digits: int = 3) -> dict:
    """Medians of both sides and of the per-round ratios (ours / theirs for rates, theirs / ours for times: above
    1 means ours is better either way), the ratios' min and max, and every round's figures."""
    if not ours or len(ours) != len(theirs):
        raise ValueError(f"need the same number (>= 1) of figures on both sides, got {len(ours)} and {len(theirs)}")
    ratios = [(a / b if higher_is_better else b / a) for a, b in zip(ours, theirs, strict=True)]
    return {
        "ours_median": round(statistics.median(ours), digits),
        "theirs_median": round(statistics.median(theirs), digits),
        "ratio_median": round(statistics.median(ratios), digits),
        "ratio_min": round(min(ratios), digits),
        "ratio_max": round(max(ratios), digits),
        "rounds": len(ratios),
        "ours_rounds": [round(x, digits) for x in ours],
        "theirs_rounds": [round(x, digits) for x in theirs],
    }

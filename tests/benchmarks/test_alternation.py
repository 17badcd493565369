"""benchmarks/alternation.py and provenance.py: the sides alternate round by round, ratios read the right way
round for rates and for times, and the environment names what it finds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from alternation import alternate, ratio_summary, round_order  # noqa: E402
from provenance import environment, package_versions  # noqa: E402


def test_sides_alternate_each_round() -> None:
    calls: list[str] = []

    def side(name: str, figure: float):
        def run() -> float:
            calls.append(name)
            return figure + len(calls)

        return run

    figures = alternate({"a": side("a", 0.0), "b": side("b", 100.0)}, rounds=4, log=False)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert figures == {"a": [1.0, 4.0, 5.0, 8.0], "b": [102.0, 103.0, 106.0, 107.0]}
    assert round_order(["x", "y", "z"], 1) == ["z", "y", "x"]


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        alternate({"a": lambda: 1.0}, rounds=0)


def test_ratio_summary_rates_and_times() -> None:
    rates = ratio_summary([10.0, 12.0, 30.0], [5.0, 6.0, 10.0])
    assert rates["ratio_median"] == 2.0 and rates["ratio_min"] == 2.0 and rates["ratio_max"] == 3.0
    assert rates["ours_median"] == 12.0 and rates["theirs_median"] == 6.0 and rates["rounds"] == 3
    # Times: smaller is better, so the ratio is theirs / ours (above 1: ours is faster).
    times = ratio_summary([1.0, 2.0], [4.0, 4.0], higher_is_better=False)
    assert times["ratio_min"] == 2.0 and times["ratio_max"] == 4.0 and times["ratio_median"] == 3.0


def test_ratio_summary_needs_matching_rounds() -> None:
    with pytest.raises(ValueError, match="same number"):
        ratio_summary([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same number"):
        ratio_summary([], [])


def test_environment_names_versions_threads_and_cpu() -> None:
    env = environment()
    assert env["versions"]["torch"] and env["threads"] >= 1 and env["cpu_flags_forced"] in (True, False)
    assert "no-such-package-xyz" not in package_versions(("torch", "no-such-package-xyz"))

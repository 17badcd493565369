"""The multiplication task (the calculator environment's rows) and the guess_number task's rows."""

import re

import pytest

from posttrain.rewards import numeric_match
from posttrain.tasks import GuessNumberTask, MultiplicationTask, TaskError, make_task
from posttrain.tasks.multiplication import HELD_OUT_PAIRS, TRAIN_PAIRS, is_held_out_pair


def operands(row):
    a, b = re.search(r"(\d+)\D+(\d+)", row["prompt"][0]["content"]).groups()
    return int(a), int(b)


def test_rows_are_three_by_two_digit_products():
    rows = make_task("multiplication", seed=3).sample(50)
    for row in rows:
        a, b = operands(row)
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == str(a * b)
    assert len({row["prompt"][0]["content"].split()[0] for row in rows}) >= 3
    assert (
        numeric_match(None, [f"The answer is {r['answer']}." for r in rows], [r["answer"] for r in rows]) == [1.0] * 50
    )


def test_deterministic_resumable_and_held_out_is_disjoint():
    task = MultiplicationTask(seed=1)
    assert task.sample(8) == MultiplicationTask(seed=1).sample(8)
    state = task.state_dict()
    expected = task.sample(8)
    resumed = MultiplicationTask(seed=5)
    resumed.load_state_dict(state)
    assert resumed.sample(8) == expected
    held = task.held_out(100)
    assert held == MultiplicationTask(seed=9).held_out(100) and held != task.held_out(100, seed=1)
    assert all(is_held_out_pair(*operands(row)) for row in held)
    assert not {operands(row) for row in MultiplicationTask(seed=2).sample(3000)} & set(HELD_OUT_PAIRS)
    assert 0.05 < len(HELD_OUT_PAIRS) / (len(HELD_OUT_PAIRS) + len(TRAIN_PAIRS)) < 0.15
    with pytest.raises(TaskError, match="seed must be an integer"):
        MultiplicationTask(seed="1")


def test_guess_number_rows():
    task = GuessNumberTask(seed=0, low=1, high=20)
    rows = task.sample(30)
    assert all(1 <= row["secret"] <= 20 and (row["low"], row["high"]) == (1, 20) for row in rows)
    assert "between 1 and 20" in rows[0]["prompt"][0]["content"]
    assert task.held_out(5) == GuessNumberTask(seed=4, low=1, high=20).held_out(5)
    with pytest.raises(TaskError, match=r"low \(5\) must be below high \(5\)"):
        GuessNumberTask(low=5, high=5)

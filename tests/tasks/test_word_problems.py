"""The word_problems task: 2-4 chained operations, exact answers, a held-out split disjoint from training, resume."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from posttrain.tasks import TASK_DEFAULT_REWARDS, TaskError, make_task
from posttrain.tasks.word_problems import MAX_VALUE, PHRASES, apply, draw_problem, evaluate, is_held_out

ROOT = Path(__file__).resolve().parents[2]


def test_rows_chain_two_to_four_exact_operations_written_in_words():
    rows = make_task("word_problems", seed=3).sample(300)
    assert {row["operations"] for row in rows} == {2, 3, 4}
    for row in rows:
        text = row["prompt"][0]["content"]
        value = row["start"]
        assert text.count("Then ") == row["operations"] == len(row["chain"])
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        assert numbers == [row["start"]] + [n for _, n in row["chain"]]  # every operand, in order, once
        for op, n in row["chain"]:
            value = apply(value, op, n)
            assert 0 < value < MAX_VALUE  # subtraction never goes below 1, multiplication stays bounded
        assert row["answer"] == str(value) == str(evaluate(row["start"], [tuple(s) for s in row["chain"]]))
    assert TASK_DEFAULT_REWARDS["word_problems"] == "numeric_match"


def test_division_is_exact_and_every_operation_has_words():
    assert set(PHRASES) == {"+", "-", "*", "/"}
    with pytest.raises(ValueError, match="not exact"):
        apply(10, "/", 3)
    rng = random.Random(0)
    ops = {op for _ in range(500) for op, _ in draw_problem(rng)[1]}
    assert ops == {"+", "-", "*", "/"}


def test_held_out_problems_are_never_sampled_and_are_fixed_by_their_seed():
    task = make_task("word_problems")
    held_out = task.held_out(200)
    assert held_out == make_task("word_problems", seed=9).held_out(200)  # the training seed does not move it
    assert held_out != task.held_out(200, seed=1)
    keys = {(r["start"], json.dumps(r["chain"])) for r in held_out}
    assert len(keys) == 200
    for row in task.sample(2000):
        assert not is_held_out(row["start"], [tuple(s) for s in row["chain"]])
    assert all(is_held_out(r["start"], [tuple(s) for s in r["chain"]]) for r in held_out)


def test_the_shipped_test_split_is_the_held_out_draw_of_seed_1():
    lines = (ROOT / "examples/data/word_problems/test.jsonl").read_text().splitlines()
    shipped = [json.loads(line) for line in lines]
    expected = make_task("word_problems").held_out(200, seed=1)
    assert len(shipped) == 200
    assert [(r["question"], r["answer"]) for r in shipped] == [
        (r["prompt"][0]["content"], r["answer"]) for r in expected
    ]
    assert {r["operations"] for r in shipped} == {2, 3, 4}


def test_state_restores_the_stream_and_bad_state_is_named():
    task = make_task("word_problems", seed=5)
    task.sample(4)
    state = task.state_dict()
    want = task.sample(4)
    again = make_task("word_problems")
    again.load_state_dict(state)
    assert again.sample(4) == want
    with pytest.raises(TaskError, match="state keys"):
        again.load_state_dict({"seed": 1})
    with pytest.raises(TaskError, match="seed must be an integer"):
        make_task("word_problems", seed="x")
    with pytest.raises(TaskError, match="non-negative"):
        task.sample(-1)


def test_operation_weights_skew_training_draws_only_and_bad_weights_are_named():
    skewed = make_task("word_problems", seed=3, operation_weights=[0, 1, 3]).sample(400)
    counts = {k: sum(r["operations"] == k for r in skewed) for k in (2, 3, 4)}
    assert counts[2] == 0 and counts[4] > 2 * counts[3] > 0  # 1:3 between three and four steps, none of two
    assert make_task("word_problems", seed=3, operation_weights=[1, 0, 0]).sample(50)[0]["operations"] == 2
    plain = make_task("word_problems", seed=3)
    assert make_task("word_problems", seed=3, operation_weights=None).sample(20) == plain.sample(20)
    # the held-out split ignores the mix: evaluations stay comparable whatever the training draws
    assert make_task("word_problems", operation_weights=[0, 0, 1]).held_out(50) == plain.held_out(50)
    for bad in ([1, 2], [1, -1, 1], [0, 0, 0], "1,2,3", [1, True, 1], [1, float("nan"), 1], [1, float("inf"), 1]):
        with pytest.raises(TaskError, match="operation_weights must be 3 non-negative numbers"):
            make_task("word_problems", operation_weights=bad)

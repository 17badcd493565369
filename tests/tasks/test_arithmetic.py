"""The demo's arithmetic task: determinism, exact resume, a disjoint held-out set, numeric_match on its rows."""

import re

import pytest

from posttrain.rewards import numeric_match
from posttrain.tasks import TASKS, ArithmeticTask, TaskError, accuracy, make_task
from posttrain.tasks.arithmetic import HELD_OUT_PAIRS, TEMPLATES, TRAIN_PAIRS, is_held_out_pair

OPERANDS_RE = re.compile(r"\b(\d{2})\b.*?\b(\d{2})\b")


def operands(row):
    a, b = OPERANDS_RE.search(row["prompt"][0]["content"]).groups()
    return int(a), int(b)


def test_rows_have_the_chat_shape_and_the_right_answer():
    rows = ArithmeticTask(seed=3).sample(50)
    for row in rows:
        assert set(row) == {"prompt", "answer"}
        (message,) = row["prompt"]
        assert message["role"] == "user" and len(message["content"].split()) <= 12  # short prompts
        a, b = operands(row)
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a + b)
    assert len({row["prompt"][0]["content"].split()[0] for row in rows}) >= 3  # several phrasings


def test_sampling_is_deterministic_fresh_and_resumable():
    first, second = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
    assert first.sample(16) == second.sample(16)
    batch_a = first.sample(16)
    assert first.sample(16) != batch_a  # each call draws fresh problems
    assert ArithmeticTask(seed=8).sample(16) != ArithmeticTask(seed=7).sample(16)

    run = ArithmeticTask(seed=1)
    run.sample(4)
    state = run.state_dict()
    assert state == {"seed": 1, "calls": 1}
    expected = [run.sample(4), run.sample(5)]
    resumed = ArithmeticTask(seed=999)
    resumed.load_state_dict(state)
    assert [resumed.sample(4), resumed.sample(5)] == expected


def test_held_out_is_fixed_distinct_and_disjoint_from_training():
    task = ArithmeticTask(seed=0)
    held = task.held_out(200)
    assert held == ArithmeticTask(seed=5).held_out(200)  # fixed, whatever the training seed
    assert held != task.held_out(200, seed=1)
    held_pairs = [operands(row) for row in held]
    assert len(set(held_pairs)) == 200 and all(is_held_out_pair(a, b) for a, b in held_pairs)
    assert not set(TRAIN_PAIRS) & set(HELD_OUT_PAIRS)
    assert 0.05 < len(HELD_OUT_PAIRS) / (len(TRAIN_PAIRS) + len(HELD_OUT_PAIRS)) < 0.15
    held_unordered = {frozenset(p) for p in HELD_OUT_PAIRS}
    for seed in range(3):  # thousands of training draws: none is a held-out problem, in either order
        trained = {frozenset(operands(row)) for row in ArithmeticTask(seed).sample(2000)}
        assert not trained & held_unordered


def test_numeric_match_scores_correct_answers_on_task_rows():
    rows = ArithmeticTask(seed=2).sample(20) + ArithmeticTask().held_out(20)
    prompts = [row["prompt"] for row in rows]
    right = [[{"role": "assistant", "content": f"The answer is {row['answer']}."}] for row in rows]
    wrong = [[{"role": "assistant", "content": str(int(row["answer"]) + 1)}] for row in rows]
    answers = [row["answer"] for row in rows]
    assert numeric_match(prompts, right, answer=answers) == [1.0] * 40
    assert numeric_match(prompts, wrong, answer=answers) == [0.0] * 40
    assert ArithmeticTask.reward == "numeric_match"


def test_errors():
    task = ArithmeticTask()
    with pytest.raises(TaskError, match=r"held_out\(n=5000\) but only \d+ held-out pairs"):
        task.held_out(5000)
    with pytest.raises(TaskError, match="n must be a non-negative integer"):
        task.sample(-1)
    with pytest.raises(TaskError, match=r"state keys must be seed, calls \(missing: calls; unknown: step\)"):
        task.load_state_dict({"seed": 0, "step": 3})
    with pytest.raises(TaskError, match=r"state\['calls'\] must be a non-negative integer"):
        task.load_state_dict({"seed": 0, "calls": -1})
    with pytest.raises(TaskError, match="seed must be an integer"):
        ArithmeticTask(seed="0")


def test_registry_and_accuracy():
    assert set(TASKS) == {"arithmetic", "gsm8k", "multiplication", "guess_number", "word_problems"}
    assert isinstance(make_task("arithmetic", seed=1), ArithmeticTask)
    with pytest.raises(
        TaskError,
        match=r"unknown task 'math' \(choose from arithmetic, gsm8k, multiplication, guess_number, word_problems\)",
    ):
        make_task("math")
    with pytest.raises(TaskError, match=r"task 'arithmetic': .*'sed' \(options: seed\)"):
        make_task("arithmetic", sed=1)
    assert len(TEMPLATES) >= 3
    assert accuracy([1.0, 0.0, None, 1.0, float("nan")]) == pytest.approx(2 / 3)
    assert accuracy([0.5, 1.0], threshold=0.5) == 1.0
    with pytest.raises(ValueError, match="no scorable rewards among 2"):
        accuracy([None, None])

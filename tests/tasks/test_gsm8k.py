"""GSM8K task: the real file's first rows, the split, seeded epochs with exact resume, bad files."""

import json

import pytest

from posttrain.rewards import gsm8k
from posttrain.tasks import GSM8KTask, TaskError, load_gsm8k
from posttrain.tasks.gsm8k import DEFAULT_PATH, INSTRUCTION


def test_real_file_first_rows_and_reward():
    rows = load_gsm8k(DEFAULT_PATH)
    first = rows[0]
    assert first["prompt"] == [
        {
            "role": "user",
            "content": (
                "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?" + INSTRUCTION
            ),
        }
    ]
    assert first["answer"].endswith("#### 72")
    assert rows[1]["answer"].endswith("#### 10")
    completions = ["48 / 2 = 24 and 48 + 24 = 72\n#### 72", "#### 10", "I am not sure."]
    prompts, answers = [r["prompt"] for r in rows[:3]], [r["answer"] for r in rows[:3]]
    assert gsm8k(prompts, completions, answer=answers) == [1.0, 1.0, 0.0]
    task = GSM8KTask(DEFAULT_PATH, held_out_size=200)
    assert len(task.train_rows) == len(rows) - 200 and task.held_out(3) == rows[-200:-197]


def write_rows(path, n):
    path.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"step\n#### {i}"}) + "\n" for i in range(n)))
    return path


def test_split_epochs_and_resume(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", 12)
    task = GSM8KTask(path, seed=3, held_out_size=2)
    held = [row["answer"] for row in task.held_out(2)]
    assert held == ["step\n#### 10", "step\n#### 11"]
    epoch0 = [row["answer"] for row in task.sample(10)]
    assert sorted(epoch0) == sorted(f"step\n#### {i}" for i in range(10))  # one epoch = every training row once
    assert epoch0 != [f"step\n#### {i}" for i in range(10)]  # shuffled
    assert task.state_dict() == {"seed": 3, "epoch": 1, "position": 0}
    epoch1 = [row["answer"] for row in task.sample(10)]
    assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0  # the next epoch, reshuffled

    again = GSM8KTask(path, seed=3, held_out_size=2)
    assert [r["answer"] for r in again.sample(10)] == epoch0  # same seed, same order
    state = again.state_dict()
    expected = again.sample(7)
    resumed = GSM8KTask(path, seed=0, held_out_size=2)
    resumed.load_state_dict(state)
    assert resumed.sample(7) == expected
    stream = iter(GSM8KTask(path, seed=3, held_out_size=2))
    assert [next(stream)["answer"] for _ in range(10)] == epoch0


def test_rows_are_copies(tmp_path):
    task = GSM8KTask(write_rows(tmp_path / "t.jsonl", 4), held_out_size=1)
    row = task.held_out(1)[0]
    row["prompt"][0]["content"] = "changed"
    assert task.held_out(1)[0]["prompt"][0]["content"] != "changed"


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ['{"question": "a?", "answer": "#### 1"}', '{"answer": "#### 2"}'],
            r"bad\.jsonl:2: row has no 'question' string",
        ),
        # an unclosed line is blamed on itself, just after its last character (not on "column 1" of line 4)
        (
            ['{"question": "a?", "answer": "#### 1"}', "", '{"question": "b?"'],
            r"bad\.jsonl:3:18: invalid JSON: Expecting ',' delimiter$",
        ),
        (
            ['["question", "answer"]'],
            r"bad\.jsonl:1: array items must be JSON objects, got str",
        ),  # read as a JSON array
        (
            ['{"question": "a?", "answer": "#### 1"}', '["question", "answer"]'],
            r"bad\.jsonl:2: expected a JSON object, got list",
        ),
        (
            ['{"question": "a?", "answer": "#### 1"}', '{"question": "\udcff"}'],
            r"bad\.jsonl:2:15: invalid UTF-8 \(byte 0xff\)",
        ),
        (['{"question": "a?", "answer": null}'], r"bad\.jsonl:1: row has no 'answer' string"),
        ([""], r"bad\.jsonl: no rows"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))  # "\udcff": the byte 0xff
    with pytest.raises(TaskError, match=message):
        load_gsm8k(path)


def test_other_errors(tmp_path):
    with pytest.raises(TaskError, match=r"data file .*missing\.jsonl not found \(pass path=\.\.\. to the task\)"):
        GSM8KTask(tmp_path / "missing.jsonl")
    path = write_rows(tmp_path / "t.jsonl", 5)
    with pytest.raises(TaskError, match=r"held_out_size must be an integer in \[0, 5\), got 5"):
        GSM8KTask(path, held_out_size=5)
    task = GSM8KTask(path, held_out_size=2)
    with pytest.raises(TaskError, match=r"held_out\(n=3\) but held_out_size is 2"):
        task.held_out(3)
    with pytest.raises(TaskError, match=r"state\['position'\] = 3 is past the 3 training rows"):
        task.load_state_dict({"seed": 0, "epoch": 0, "position": 3})

"""The prompts an evaluation generates for: a built-in task's held-out problems, or the rows of a dataset
file (JSONL, JSON, Parquet, a saved HF dataset) with a prompt column and a reference-answer column.

Rows come out as the RL trainer's rollout rows (`posttrain.rollout.prompts.prompt_row`): `prompt` holds
chat messages (a string prompt becomes one user turn, after an optional system message), every other
column stays, and the reference column is renamed to `answer`, the name the built-in answer rewards read.
A missing column is an error naming the file and line; a null reference is kept: the reward then cannot
score that row and it is reported as unscorable, never silently as wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.readers import read_rows, row_location
from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError
from posttrain.rollout.batch import PROMPT_KEY
from posttrain.rollout.prompts import prompt_row

ANSWER_KEY = "answer"  # where the reference answer sits in a row


@dataclass
class EvalRows:
    rows: list[dict[str, Any]]  # {"prompt": [messages], "answer": reference, ...other columns}
    source: str  # "task arithmetic" or the file path, for reports
    default_reward: str | None  # the task's reward spec; None for a file (the caller must name one)
    locations: list[str]  # per row: "file:line" (or "task arithmetic, problem 3"), for error messages


def task_rows(name: str, num: int, path: str | Path | None = None) -> EvalRows:
    """The first `num` held-out problems of a built-in task (`path`: the task's data file, for gsm8k).

    The same rows the RL trainer scores before and after training with `data.eval_size=num`."""
    from posttrain.tasks import make_task

    options: dict[str, Any] = {}
    if path is not None:
        options["path"] = path
    if name == "gsm8k":
        options["held_out_size"] = num
    task = make_task(name, **options)
    rows = task.held_out(num)
    return EvalRows(rows, f"task {name}", task.reward, [f"task {name}, held-out problem {i}" for i in range(len(rows))])


def file_rows(
    path: str | Path,
    prompt_column: str = "prompt",
    answer_column: str = ANSWER_KEY,
    *,
    max_rows: int | None = None,
    system_prompt: str | None = None,
    template: str | None = None,
    answer_required: bool = True,
) -> EvalRows:
    """Rows of a dataset file with `prompt_column` (text or chat messages) and `answer_column` (any JSON
    value, or a list of references for EM / F1). `template` (e.g. "{question}\\nAnswer:") builds a text
    prompt from the row's columns. `answer_required=False`: rows without the answer column pass as they are
    (an environment that scores its episodes itself, such as guess_number, has no reference answer)."""
    if max_rows is not None and max_rows < 1:
        raise PosttrainError(f"max_rows must be >= 1, got {max_rows}")
    if prompt_column == answer_column:
        raise PosttrainError(f"the prompt and answer columns must differ (both are {prompt_column!r})")
    rows: list[dict[str, Any]] = []
    locations: list[str] = []
    for n, record in read_rows(path):
        if max_rows is not None and len(rows) >= max_rows:
            break
        where = row_location(path, n)
        for role, column in (("prompt", prompt_column), ("answer", answer_column)):
            if column not in record and (role == "prompt" or answer_required):
                raise DataError(f"{where}: no {role} column {column!r} (columns: {', '.join(record) or 'none'})")
        if answer_column != ANSWER_KEY and ANSWER_KEY in record:
            raise DataError(
                f"{where}: the answer column {answer_column!r} would be renamed to {ANSWER_KEY!r}, "
                f"but the row already has an {ANSWER_KEY!r} column"
            )
        record = {(ANSWER_KEY if key == answer_column else key): value for key, value in record.items()}
        rows.append(prompt_row(record, prompt_column, where, template, system_prompt))
        locations.append(where)
    if not rows:
        raise DataError(f"{path}: no rows")
    return EvalRows(rows, str(path), None, locations)


def check_prompt_column(rows: list[dict[str, Any]]) -> None:
    """Every row must carry its prompt (a caller-built row list, e.g. from the Python API)."""
    for index, row in enumerate(rows):
        if PROMPT_KEY not in row:
            raise PosttrainError(f"row {index}: no {PROMPT_KEY!r} key (keys: {', '.join(row) or 'none'})")

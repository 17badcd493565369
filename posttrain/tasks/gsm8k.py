"""GSM8K grade-school math as an RL task, from the jsonl file of `{"question", "answer"}` rows.

Each row becomes `{"prompt": [{"role": "user", "content": question + INSTRUCTION}], "answer": <the
original answer text, ending in "#### n">}`, scored by the `gsm8k` reward. The last `held_out_size`
rows of the file (by index) are the held-out split; training cycles over the others, epoch after
epoch, each epoch in its own order shuffled from (seed, epoch). The position (epoch, index in epoch)
is the whole state, so a resumed run continues with exactly the rows it would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.data.readers import read_json_rows
from posttrain.data.validate import DataError
from posttrain.tasks.base import TaskError, check_count, check_state

# GSM8K's train split ships with the repository (examples/data/gsm8k, MIT) for the examples and the default.
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k" / "train.jsonl"
INSTRUCTION = "\nSolve it step by step, then give the final answer on the last line as '#### <number>'."


def load_gsm8k(path: str | Path) -> list[dict[str, Any]]:
    """Prompt rows from a GSM8K jsonl file; errors name file:line (no 'question' / 'answer') or
    file:line:column (bad JSON or UTF-8), as the shared data readers spell them."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TaskError(f"gsm8k task: data file {path} not found (pass path=... to the task)")
    rows = []
    try:
        for line_number, record in read_json_rows(path):
            for key in ("question", "answer"):
                if not isinstance(record.get(key), str) or not record[key].strip():
                    raise TaskError(f"{path}:{line_number}: row has no {key!r} string")
            rows.append(
                {
                    "prompt": [{"role": "user", "content": record["question"].strip() + INSTRUCTION}],
                    "answer": record["answer"],
                }
            )
    except DataError as error:  # undecodable: reported as this task's error
        raise TaskError(str(error)) from None
    if not rows:
        raise TaskError(f"{path}: no rows")
    return rows


class GSM8KTask:
    """GSM8K rows: `sample(n)` / iteration over the training split, `held_out(n)` from the last rows."""

    name = "gsm8k"
    reward = "gsm8k"

    def __init__(self, path: str | Path = DEFAULT_PATH, seed: int = 0, held_out_size: int = 200) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TaskError(f"gsm8k task: seed must be an integer, got {seed!r}")
        rows = load_gsm8k(path)
        if isinstance(held_out_size, bool) or not isinstance(held_out_size, int) or not 0 <= held_out_size < len(rows):
            raise TaskError(f"gsm8k task: held_out_size must be an integer in [0, {len(rows)}), got {held_out_size!r}")
        split = len(rows) - held_out_size
        self.train_rows, self.held_out_rows = rows[:split], rows[split:]
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into this epoch's order
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = list(range(len(self.train_rows)))
            random.Random(f"gsm8k:{self.seed}:{self.epoch}").shuffle(self._order)
        return self._order

    def sample(self, n: int) -> list[dict[str, Any]]:
        """The next n training rows, continuing into the next epoch (reshuffled) when one ends."""
        check_count(n, "gsm8k task: sample(n)")
        out = []
        for _ in range(n):
            out.append(self.train_rows[self._epoch_order()[self.position]])
            self.position += 1
            if self.position == len(self.train_rows):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return [_copy_row(row) for row in out]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Training rows forever, one at a time (the same stream `sample` draws from)."""
        while True:
            yield self.sample(1)[0]

    def held_out(self, n: int = 200) -> list[dict[str, Any]]:
        """The first n rows of the held-out split (the file's last held_out_size rows), in file order."""
        check_count(n, "gsm8k task: held_out(n)")
        if n > len(self.held_out_rows):
            raise TaskError(f"gsm8k task: held_out(n={n}) but held_out_size is {len(self.held_out_rows)}")
        return [_copy_row(row) for row in self.held_out_rows[:n]]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("seed", "epoch", "position"), "gsm8k task")
        if state["position"] >= len(self.train_rows):
            raise TaskError(
                f"gsm8k task: state['position'] = {state['position']} is past the "
                f"{len(self.train_rows)} training rows (a different file or held_out_size?)"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = None


def _copy_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row the caller may modify without changing the task's copy."""
    return {"prompt": [dict(message) for message in row["prompt"]], "answer": row["answer"]}

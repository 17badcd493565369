"""`eval.save_best`: keep the model at its best held-out accuracy, beside the last one.

RL on a small model is not monotone: a recipe can climb for fifty steps and then drift (docs/agents.md), and the
last step is not the run's best. With `eval.save_best: true` every held-out evaluation (before the first step,
every `eval.every` steps, after the last) that beats the best accuracy so far writes `<run>/best` (what `final`
would hold at that step: an HF directory or the PEFT adapter, the value head beside it) and `<run>/best.json`
(`{"step", "accuracy"}`). Ties keep the earlier model. Both are written atomically, model first, so a crash
leaves the previous best whole; a resumed run reads best.json and only a better evaluation replaces it.

The held-out prompts of `data.eval_size` are the task's held-out split (its own seed): selecting on them is
early stopping on a validation set. Report the chosen model on a test set it was not selected on (the demos'
`--data .../test.jsonl`, another seed of the held-out split).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.distributed.env import is_main

BEST_DIR = "best"
BEST_RECORD = "best.json"


def best_record(run_dir: Path) -> dict[str, Any] | None:
    """`{"step", "accuracy"}` of the run's best model so far, or None before one was saved."""
    path = Path(run_dir) / BEST_RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


class BestModel:
    """Writes `<run>/best` when an evaluation beats the best accuracy seen (see the module docstring).

    `save(out)` writes the run's model to `out`; under torchrun every rank calls `offer` alike (each evaluates
    every held-out prompt greedily, so the accuracy is the same everywhere) and `save` gathers as it must."""

    def __init__(self, run_dir: Path, save: Callable[[Path], None]) -> None:
        self.run_dir = Path(run_dir)
        self.save = save
        record = best_record(self.run_dir)
        self.step: int | None = record["step"] if record else None
        self.accuracy: float = record["accuracy"] if record else float("-inf")

    @property
    def dir(self) -> Path:
        return self.run_dir / BEST_DIR

    def offer(self, step: int, accuracy: float) -> bool:
        """Save the model as the best when `accuracy` beats the best so far; True when it did."""
        if not accuracy > self.accuracy:  # ties keep the earlier model; NaN never wins
            return False
        self.save(self.dir)
        self.step, self.accuracy = step, float(accuracy)
        if is_main():
            tmp = self.run_dir / f".{BEST_RECORD}.tmp"
            tmp.write_text(json.dumps({"step": step, "accuracy": self.accuracy}) + "\n", encoding="utf-8")
            os.replace(tmp, self.run_dir / BEST_RECORD)
        return True

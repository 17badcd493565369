"""Numerical faults: an update whose loss or gradient norm is not finite is skipped (see
`optim.optimizer_step`); this counts them and ends the run after `max_bad_steps` in a row.

One skipped update is weather (a rare overflow, one poisoned batch); several in a row mean the run has
diverged, and going on would only burn compute, so it stops with a message that says where and why.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from posttrain.errors import PosttrainError

logger = logging.getLogger("posttrain.trainers")


class NumericalFault(PosttrainError):
    """Too many non-finite updates in a row; the message names the step and the values."""


def fault_reason(loss: float | None, grad_norm: float) -> str:
    """Why an update was skipped, e.g. 'loss=nan' or 'grad_norm=inf' (both when both are bad)."""
    parts = []
    if loss is not None and not math.isfinite(loss):
        parts.append(f"loss={loss}")
    if not math.isfinite(grad_norm):
        parts.append(f"grad_norm={grad_norm}")
    return ", ".join(parts) or "non-finite update"


class BadStepGuard:
    """Counts skipped updates: `in_a_row` resets on a good one, `total` never does. Checkpointed with the
    run (`state_dict`), so a resumed run aborts exactly where the uninterrupted one would."""

    def __init__(self, max_in_a_row: int) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"max_bad_steps must be at least 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def record(self, step: int, applied: bool, loss: float | None, grad_norm: float) -> None:
        """After each optimizer step (`step` as the user counts it, 1-based); raises NumericalFault on the
        `max_in_a_row`-th skipped update in a row."""
        if applied:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        reason = fault_reason(loss, grad_norm)
        logger.warning(
            "step %d: %s: update skipped, weights and optimizer state unchanged (%d in a row, %d in all)",
            step,
            reason,
            self.in_a_row,
            self.total,
        )
        if self.in_a_row >= self.max_in_a_row:
            raise NumericalFault(
                f"step {step}: {self.in_a_row} updates in a row skipped for non-finite values (last: {reason}); "
                f"aborting at train.max_bad_steps={self.max_in_a_row}. Lower optim.lr, check the data around "
                "this step, or resume from an earlier checkpoint"
            )

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])

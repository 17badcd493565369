"""Learning-rate schedules: linear warmup, then cosine, linear or constant. One function per shape."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

# progress in [0, 1) after warmup -> multiplier of the peak lr, before the floor is applied
SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0) -> float:
    """The lr of optimizer step `step` (0-based) as a fraction of the peak.

    Warmup rises linearly to the peak: (step + 1) / warmup_steps, so the first step already learns and
    step warmup_steps - 1 runs at the peak. The decay then runs from 1 towards `min_lr_ratio` over the
    remaining steps (as in transformers' schedules, the last step is just short of the floor).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * SCHEDULES[schedule](min(progress, 1.0))


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    """`warmup_steps` if set, else `ceil(warmup_ratio * total_steps)`."""
    return warmup_steps if warmup_steps else math.ceil(warmup_ratio * total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR; call `.step()` once after each optimizer step."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")
    fn = partial(
        lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule, min_lr_ratio=min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class ScheduleFields(Protocol):
    """What `scheduler_for` reads of an `optim:` section (`sections.OptimSection`, which imports this module)."""

    schedule: str
    min_lr_ratio: float
    warmup_steps: int
    warmup_ratio: float


def scheduler_for(
    optimizer: torch.optim.Optimizer, optim: ScheduleFields, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`build_scheduler` with an `optim:` section's schedule, floor and warmup (steps, or a ratio of the total)."""
    return build_scheduler(
        optimizer,
        total_steps=total_steps,
        schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio,
        warmup_steps=warmup_steps_for(total_steps, optim.warmup_steps, optim.warmup_ratio),
    )

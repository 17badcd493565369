"""Gradient accumulation with one normaliser for the whole optimizer step.

Each micro-batch's loss is a *sum* (over tokens, pairs, ...); dividing every one of them by the
same `denominator` (the count over all micro-batches of the step) makes the accumulated gradient
equal to that of one big batch, whatever the split. Averaging per-micro-batch means instead would
weight a short micro-batch's tokens more than a long one's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

# micro-batch -> (loss summed over its items, extra metric sums)
LossSumFn = Callable[[T], tuple[torch.Tensor, dict[str, float]]]


def accumulate_gradients(micro_batches: Sequence[T], loss_sum_fn: LossSumFn, denominator: float) -> dict[str, float]:
    """Backward each micro-batch's loss_sum / denominator; returns {"loss": total / denominator, **metric sums}."""
    if denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    total = 0.0
    sums: dict[str, float] = {}
    for micro in micro_batches:
        loss_sum, extra = loss_sum_fn(micro)
        (loss_sum / denominator).backward()
        total += float(loss_sum.detach())
        for key, value in extra.items():
            sums[key] = sums.get(key, 0.0) + value
    return {"loss": total / denominator, **sums}

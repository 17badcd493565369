"""Gradient accumulation with one normaliser for the whole optimizer step.

Each micro-batch's loss is a *sum* (over tokens, pairs, ...); dividing every one of them by the
same `denominator` (the count over all micro-batches of the step) makes the accumulated gradient
equal to that of one big batch, whatever the split. Averaging per-micro-batch means instead would
weight a short micro-batch's tokens more than a long one's.

Data-parallel: each rank passes its own share of the micro-batches and the GLOBAL denominator (the count
over every rank, `posttrain.distributed.all_reduce_count`); `parallel` then reduces the gradients once, on the
last micro-batch, and its `loss_scale` undoes the ranks' averaging (see `posttrain.distributed.parallel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from posttrain.distributed.parallel import Parallel

T = TypeVar("T")

# micro-batch -> (loss summed over its items, extra metric sums)
LossSumFn = Callable[[T], tuple[torch.Tensor, dict[str, float]]]


def accumulate_gradients(
    micro_batches: Sequence[T], loss_sum_fn: LossSumFn, denominator: float, parallel: Parallel | None = None
) -> dict[str, float]:
    """Backward each micro-batch's loss_sum / denominator; returns {"loss": total / denominator, **metric sums}
    (with `parallel`, this rank's part of the loss: the ranks' parts sum to the step's loss)."""
    if denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    scale = parallel.loss_scale if parallel is not None else 1.0
    total = 0.0
    sums: dict[str, float] = {}
    last = len(micro_batches) - 1
    for index, micro in enumerate(micro_batches):
        with parallel.grad_sync(index == last) if parallel is not None else contextlib.nullcontext():
            loss_sum, extra = loss_sum_fn(micro)
            loss = loss_sum / denominator
            (loss * scale if scale != 1.0 else loss).backward()
        total += float(loss_sum.detach())
        for key, value in extra.items():
            sums[key] = sums.get(key, 0.0) + value
    return {"loss": total / denominator, **sums}


"""Gradient accumulation with one normaliser for the whole optimizer step.

Each micro-batch's loss is a *sum* (over tokens, pairs, ...); dividing every one of them by the
same `denominator` (the count over all micro-batches of the step) makes the accumulated gradient
equal to that of one big batch, whatever the split. Averaging per-micro-batch means instead would
weight a short micro-batch's tokens more than a long one's.

A loss of several terms with different normalisers (RL: the policy term by its aggregation's count, the
value loss by tokens) passes its sums and their denominators as two mappings with the same keys: a
micro-batch's loss is then sum_k sums[k] / denominator[k] (a micro-batch may leave a term out: 0).

Data-parallel: each rank passes its own share of the micro-batches and the GLOBAL denominator (the count
over every rank, `posttrain.distributed.all_reduce_count`); `parallel` then reduces the gradients once, on the
last micro-batch, and its `loss_scale` undoes the ranks' averaging (see `posttrain.distributed.parallel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from posttrain.distributed.parallel import Parallel

T = TypeVar("T")

# micro-batch -> (loss summed over its items, or the sums of named terms; extra metric sums)
LossSumFn = Callable[[T], tuple[torch.Tensor | Mapping[str, torch.Tensor], dict[str, float]]]


def accumulate_gradients(
    micro_batches: Sequence[T],
    loss_sum_fn: LossSumFn,
    denominator: float | Mapping[str, float],
    parallel: Parallel | None = None,
) -> dict[str, float]:
    """Backward each micro-batch's loss_sum / denominator; returns {"loss": total / denominator, **metric sums}
    (with `parallel`, this rank's part of the loss: the ranks' parts sum to the step's loss). With named
    terms, "loss" is sum_k total_k / denominator[k]."""
    named = isinstance(denominator, Mapping)
    denominators = dict(denominator) if named else {"": denominator}
    for key, value in denominators.items():
        if value <= 0:
            raise ValueError(f"denominator{f' {key!r}' if named else ''} must be positive, got {value}")
    scale = parallel.loss_scale if parallel is not None else 1.0
    totals = dict.fromkeys(denominators, 0.0)
    sums: dict[str, float] = {}
    last = len(micro_batches) - 1
    for index, micro in enumerate(micro_batches):
        with parallel.grad_sync(index == last) if parallel is not None else contextlib.nullcontext():
            loss_sum, extra = loss_sum_fn(micro)
            terms = loss_sum if named else {"": loss_sum}
            loss = None
            for key, term in terms.items():
                part = term / denominators[key]
                loss = part if loss is None else loss + part
            if loss is not None:
                (loss * scale if scale != 1.0 else loss).backward()
        for key, term in terms.items():
            totals[key] += float(term.detach())
        for key, value in extra.items():
            sums[key] = sums.get(key, 0.0) + value
    return {"loss": sum(totals[key] / denominators[key] for key in totals), **sums}

"""The step loop shared by the trainers, and the small pieces around it.

A trainer owns its step (what a batch is, what the loss is); `run_steps` owns everything around it:
the progress bar (loss, lr, tokens/s), timing, metrics records, periodic evaluation and
checkpoints. A step function does one whole optimizer step and returns its metrics, which must
include `loss` and `tokens` (tokens processed, for throughput).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from posttrain.metrics import MetricsLogger

T = TypeVar("T")

StepFn = Callable[[int], dict[str, float]]  # 0-based step -> metrics of that step


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if installed) and torch's generators (all devices)."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def batch_stream(items: Sequence[T], batch_size: int, seed: int, shuffle: bool = True) -> Iterator[list[T]]:
    """Endless batches over reshuffled epochs (epoch e shuffled by Random(seed + e)). A batch may span
    the end of one epoch and the start of the next, so every batch is full."""
    if not items:
        raise ValueError("no items to batch")
    epoch, batch = 0, []
    while True:
        order = list(range(len(items)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for i in order:
            batch.append(items[i])
            if len(batch) == batch_size:
                yield batch
                batch = []
        epoch += 1


def steps_for_epochs(num_items: int, epochs: float, items_per_step: int) -> int:
    return max(1, math.ceil(epochs * num_items / items_per_step))


def run_steps(
    step_fn: StepFn,
    *,
    max_steps: int,
    optimizer: torch.optim.Optimizer,
    metrics: MetricsLogger | None = None,
    log_every: int = 1,
    save_every: int = 0,
    save_fn: Callable[[int], object] | None = None,
    eval_every: int = 0,
    eval_fn: Callable[[], dict[str, float]] | None = None,
    progress: bool = True,
    desc: str = "train",
) -> dict[str, float]:
    """Run `max_steps` steps; returns the last step's record.

    Records are written under step numbers 1..max_steps (the count of finished updates) with `lr`
    (the rate that step used), `step_time` (s) and `tokens_per_s` added to the step's own metrics.
    `save_fn(step)` runs every `save_every` steps (not after the last: the caller saves the final
    model); `eval_fn()` every `eval_every` steps and after the last one, its metrics logged too.
    """
    record: dict[str, float] = {}
    bar = tqdm(total=max_steps, desc=desc, disable=not progress, dynamic_ncols=True)
    try:
        for step in range(max_steps):
            lr = optimizer.param_groups[0]["lr"]
            start = time.perf_counter()
            out = step_fn(step)
            elapsed = time.perf_counter() - start
            done = step + 1
            record = {**out, "lr": lr, "step_time": elapsed, "tokens_per_s": out["tokens"] / elapsed}
            if eval_fn is not None and ((eval_every and done % eval_every == 0) or done == max_steps):
                record.update(eval_fn())
            if metrics is not None and (done % log_every == 0 or done == max_steps or "eval_loss" in record):
                metrics.log(done, record)
            bar.set_postfix(loss=f"{out['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}",
                            refresh=False)
            bar.update(1)
            if save_fn is not None and save_every and done % save_every == 0 and done != max_steps:
                save_fn(done)
    finally:
        bar.close()
    return record

"""The step loop shared by the trainers, and the small pieces around it.

A trainer owns its step (what a batch is, what the loss is); `run_steps` owns everything around it:
the progress bar (loss, lr, tokens/s), timing, metrics records, periodic evaluation and
checkpoints. A step function does one whole step and returns its metrics, with `loss` and `tokens`
(tokens processed, for throughput) where it has them.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from posttrain.metrics import MetricsLogger
from posttrain.trainers.progress import StepProgress

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


class BatchStream(Generic[T]):
    """Endless batches over reshuffled epochs (epoch e shuffled by Random(seed + e)). A batch may span
    the end of one epoch and the start of the next, so every batch is full.

    Batch b holds positions [b * batch_size, (b + 1) * batch_size) of the epochs laid end to end, so the
    stream can start at any batch without replaying the ones before it: `position` counts the batches
    drawn and is all a checkpoint needs (`state_dict`)."""

    def __init__(self, items: Sequence[T], batch_size: int, seed: int, shuffle: bool = True, start: int = 0) -> None:
        if not items:
            raise ValueError("no items to batch")
        if batch_size < 1 or start < 0:
            raise ValueError(f"batch_size must be >= 1 and start >= 0, got {batch_size} and {start}")
        self.items, self.batch_size, self.seed, self.shuffle = items, batch_size, seed, shuffle
        self.position = start
        self._epoch, self._order = -1, []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:  # one shuffle per epoch, kept while the stream is in it
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def __next__(self) -> list[T]:
        n = len(self.items)
        first = self.position * self.batch_size
        batch = []
        for flat in range(first, first + self.batch_size):
            epoch, offset = divmod(flat, n)
            batch.append(self.items[self._order_of(epoch)[offset]])
        self.position += 1
        return batch

    def __iter__(self) -> BatchStream[T]:
        return self

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def batch_stream(
    items: Sequence[T], batch_size: int, seed: int, shuffle: bool = True, start: int = 0
) -> BatchStream[T]:
    """`BatchStream(items, batch_size, seed, shuffle, start)`: endless, resumable batches."""
    return BatchStream(items, batch_size, seed, shuffle, start)


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
    postfix: dict[str, str] | None = None,
    start_step: int = 0,
    should_stop: Callable[[int], bool] | None = None,
    budget_s: float | None = None,
    started: float | None = None,
    reserve_s: float = 0.0,
) -> dict[str, float]:
    """Run steps `start_step`..`max_steps - 1` (a resumed run starts past 0); returns the last step's record.

    Records are written under step numbers 1..max_steps (the count of finished updates) with `lr`
    (the rate that step used), `time/step_s` and `tokens/train_per_s` (from the step's `tokens`) added
    to the step's own metrics, unless the step measured them itself (RL times its phases and its update).
    `save_fn(step)` runs every `save_every` steps (not after the last: the caller saves the final
    model); `eval_fn()` every `eval_every` steps and after the last one, its metrics logged too.
    `postfix` adds the trainer's headline metrics to the bar: {label: metric key} (a key the step
    does not return is left out), e.g. DPO's pairwise accuracy and margin next to the loss.
    `should_stop(steps_done)` is asked before every step (RL's time budget); True ends the run there.
    `budget_s` (counted from `started`, less the `reserve_s` kept after the last step) is the time bound the
    progress bar weighs against `max_steps` (trainers.progress); the stop itself is `should_stop`'s.
    """
    record: dict[str, float] = {}
    bar = StepProgress(
        max_steps,
        budget_s=budget_s,
        enabled=progress,
        desc=desc,
        start_step=start_step,
        started=started,
        reserve_s=reserve_s,
    )
    try:
        for step in range(start_step, max_steps):
            if should_stop is not None and should_stop(step):
                break
            lr = optimizer.param_groups[0]["lr"]
            start = time.perf_counter()
            out = step_fn(step)
            elapsed = time.perf_counter() - start
            done = step + 1
            measured = {"lr": lr, "time/step_s": elapsed}
            if "tokens" in out:
                measured["tokens/train_per_s"] = out["tokens"] / elapsed
            record = {**out, **{key: value for key, value in measured.items() if key not in out}}
            if eval_fn is not None and ((eval_every and done % eval_every == 0) or done == max_steps):
                record.update(eval_fn())
            if metrics is not None and (done % log_every == 0 or done == max_steps or "eval_loss" in record):
                metrics.log(done, record)
            shown = {"loss": f"{out['loss']:.4f}"} if "loss" in out else {}
            shown.update({label: f"{float(out[key]):.3g}" for label, key in (postfix or {}).items() if key in out})
            shown["lr"] = f"{lr:.2e}"
            if "tokens/train_per_s" in record:
                shown["tok_s"] = f"{record['tokens/train_per_s']:.0f}"
            bar.set_postfix(**shown)
            bar.step_done(done)
            if save_fn is not None and save_every and done % save_every == 0 and done != max_steps:
                save_fn(done)
    finally:
        bar.close()
    return record

"""Where an asynchronous RL trainer takes its rollout batches from: the `RolloutProducer` interface, and the
in-process producer (`ThreadedProducer`: the engine in its own thread, on the module being trained).

The interface (what the trainer consumes; a producer over separate rollout processes implements the same):

    producer.get(step)          -> ProducedBatch   the scored batch collected for RL step `step` (1-based),
                                                   blocking; raises RolloutWorkerError when the producer failed
                                                   or gave nothing within its timeout
    producer.update_done(step)                     the trainer finished step `step`'s update (its optimizer
                                                   steps and weights_updated() calls are done): the producer may
                                                   now start collecting step `step + 1 + lead`
    producer.exclusive()        -> context         the engine to the trainer alone (held-out evaluation, refills)
    producer.timing()           -> ProducerTiming  cumulative busy / idle seconds of the rollout side
    producer.close()                               stop; waits for a collection in flight to end

`lead` = how many steps ahead of the update the rollout may run: with U optimizer steps per RL step and the bound
`rollout.max_staleness` = k (in policy versions), lead = k // U. Batch `step` is then started only once the weights
are those after step `step - 1 - lead`, so every token it draws is at most lead * U <= k versions old when step
`step` trains on it; the trainer still checks each sample (`rollout.staleness.split_stale`) and drops what is past
the bound. Every token records the version it was drawn under (`RolloutBatch.token_versions`), whatever the
producer. With k = 0 (lead 0) the producer collects step s after update s - 1, exactly what sync mode does.

Why a thread (and not interleaving engine steps with update micro-steps): the engine's forwards and the update's
forward / backward are long torch calls that release the GIL, so two threads overlap them on two cores with no
change to either side's code; interleaving would need the update cut into resumable pieces and could never run
both at once. Weights change only between engine steps: every engine step holds `LLM.weights_lock`, and the
trainer holds it around each optimizer step and the `weights_updated()` after it (which drops the prefix cache
and bumps the version, so the following tokens record the new version and no block computed under old weights is
served to another sequence; running sequences go on over their K/V or recompute it, `rollout.running_kv`).
Cores: `cores` (rollout/core_share.py) gives the rollout thread all of them while the update waits for a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.errors import PosttrainError
from posttrain.rollout.batch import RolloutBatch
from posttrain.rollout.collect import RolloutStats
from posttrain.rollout.core_share import CoreShare

logger = logging.getLogger("posttrain.rollout")


class RolloutWorkerError(PosttrainError):
    """The rollout side failed or hung; the message says which step and why."""


@dataclass
class ProducedBatch:
    """What the producer collected for one RL step."""

    step: int
    batch: RolloutBatch | None  # None: dynamic sampling left no group with a signal
    stats: RolloutStats
    metrics: dict[str, Any] = field(default_factory=dict)  # the collection's own metrics (dapo/*, env/*, ...)


@dataclass
class ProducerTiming:
    busy_s: float = 0.0  # seconds spent collecting
    idle_s: float = 0.0  # seconds waiting for the update to let it start the next step


class RolloutProducer(Protocol):
    def get(self, step: int) -> ProducedBatch: ...

    def update_done(self, step: int) -> None: ...

    def exclusive(self) -> Any: ...  # a context manager

    def timing(self) -> ProducerTiming: ...

    def close(self) -> None: ...


class ThreadedProducer:
    """Collects steps first_step..last_step in a daemon thread with `collect(step)`, at most `lead` steps ahead of
    the update. `timeout_s`: how long `get` waits for a batch before it gives up (the thread hangs). `start`: start
    the thread now (else `start()`). `hold()`: entered inside `exclusive`, once no collection is in flight: what
    the engine must set aside between collections for another caller (episodes started ahead, parked)."""

    def __init__(
        self,
        collect: Callable[[int], ProducedBatch],
        first_step: int,
        last_step: int,
        lead: int,
        timeout_s: float,
        on_start: Callable[[], None] | None = None,
        cores: CoreShare | None = None,
        start: bool = True,
        hold: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        if lead < 0:
            raise ValueError(f"lead must be >= 0, got {lead}")
        self.collect, self.lead, self.timeout_s = collect, lead, timeout_s
        self.last_step = last_step
        self._done_step = first_step - 1  # the last step whose update is done
        self._ready: dict[int, ProducedBatch] = {}
        self._error: tuple[int, BaseException] | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._engine = threading.Lock()  # held for a whole collection; `exclusive` takes it between them
        self._timing = ProducerTiming()
        self._on_start = on_start
        self._cores = cores  # the rollout's share of the cores (None: leave torch's threads alone)
        self._hold = hold
        self._thread = threading.Thread(target=self._run, args=(first_step,), name="posttrain-rollout", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the thread (for a producer made with start=False: its owner finishes wiring it first)."""
        self._thread.start()

    def _run(self, step: int) -> None:
        if self._on_start is not None:
            self._on_start()
        if self._cores is not None:
            self._cores.register("rollout")
        try:
            while step <= self.last_step:
                waited = time.perf_counter()
                with self._cond:
                    if step > self._done_step + 1 + self.lead:
                        self._set_busy(False)  # at the staleness bound: the update may take every core
                    while not self._stopped and step > self._done_step + 1 + self.lead:
                        self._cond.wait()
                    self._set_busy(True)
                    if self._stopped:
                        return
                started = time.perf_counter()
                self._timing.idle_s += started - waited
                with self._engine:
                    produced = self.collect(step)
                self._timing.busy_s += time.perf_counter() - started
                with self._cond:
                    self._ready[step] = produced
                    self._cond.notify_all()
                step += 1
        except BaseException as error:  # handed to the trainer by `get`; the traceback goes to the log
            logger.debug("the rollout thread failed at step %d", step, exc_info=True)
            with self._cond:
                self._error = (step, error)
                self._cond.notify_all()
        finally:
            self._set_busy(False)  # done (or failed): the update may take every core

    def _set_busy(self, busy: bool) -> None:
        if self._cores is not None:
            self._cores.busy("rollout", busy)

    def may_start(self, step: int) -> bool:
        """Whether the bound lets collection of `step` start now (what the thread waits for between steps)."""
        with self._cond:
            return step <= self._done_step + 1 + self.lead

    def get(self, step: int) -> ProducedBatch:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    failed, error = self._error
                    raise RolloutWorkerError(
                        f"the rollout thread failed while collecting step {failed}: {type(error).__name__}: {error}"
                    ) from error
                if not self._thread.is_alive():
                    raise RolloutWorkerError(f"the rollout thread ended before collecting step {step}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutWorkerError(
                        f"no rollout batch for step {step} within {self.timeout_s:g} s "
                        "(rollout.async_timeout_s): the rollout thread hangs or is far too slow"
                    )
                self._cond.wait(timeout=min(left, 1.0))
            return self._ready.pop(step)

    def update_done(self, step: int) -> None:
        with self._cond:
            self._done_step = max(self._done_step, step)
            self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine to the caller alone: waits for a collection in flight to end, holds the next one back."""
        if not self._engine.acquire(timeout=self.timeout_s):
            raise RolloutWorkerError(
                f"the rollout thread held the engine for more than {self.timeout_s:g} s (rollout.async_timeout_s)"
            )
        try:
            with self._hold() if self._hold is not None else nullcontext():
                yield
        finally:
            self._engine.release()

    def timing(self) -> ProducerTiming:
        return ProducerTiming(self._timing.busy_s, self._timing.idle_s)

    def close(self) -> None:
        """Stop after the collection in flight (waiting for it at most `timeout_s`: a hung thread is left behind,
        a daemon)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s)

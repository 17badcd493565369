"""The lock between the engine's steps and whoever changes the weights (a trainer in another thread).

Why not a plain RLock: a rollout thread steps the engine in a tight loop, releasing the lock at the end of a
step and taking it again at once. Python's locks are not fair, so a trainer waiting to apply its optimizer step
could wait many engine steps: measured in async GRPO on 2 cores, 7-9 s of a 7.5-10 s update went to that wait,
and the two sides ran one after the other instead of side by side. Here an engine step waits while a writer is
waiting, so a writer gets the lock at the end of the step in progress.

`with lock:` is the writer's side (the trainer: optimizer step + weights_updated(); re-entrant, as
`weights_updated()` takes it again). `with lock.engine_step():` is the engine's, once per step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class WeightsLock:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state = threading.Condition(threading.Lock())
        self._writers_waiting = 0

    def __enter__(self) -> WeightsLock:
        with self._state:
            self._writers_waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._state:
                self._writers_waiting -= 1
                self._state.notify_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @contextmanager
    def engine_step(self) -> Iterator[None]:
        """Hold the lock for one engine step, after letting every waiting writer go first."""
        with self._state:
            while self._writers_waiting:
                self._state.wait()
        with self._lock:
            yield

"""Worker threads for environment calls, so that tools run while the engine decodes other episodes.

Why not `concurrent.futures.ThreadPoolExecutor`: a call that overruns its bound cannot be stopped (Python
threads cannot be killed), and the executor's threads are joined when the interpreter exits, so one hung call
would hang the process at its end. These workers are daemon threads; a call given up on keeps its thread, and
`abandon` starts another one in its place so the pool keeps its width. The environment layer bounds each tool
call itself (subprocess timeouts); this bound is the rollout's safety net around a whole `step`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EnvWorkers:
    """`submit(fn)` runs fn() on one of `width` daemon threads and returns its Future; `busy_s` sums the seconds
    calls ran (the environment's share of a rollout)."""

    def __init__(self, width: int) -> None:
        self.jobs: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self.busy_s = 0.0
        self._lock = threading.Lock()
        self._threads = [self._start() for _ in range(max(1, width))]

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="posttrain-env", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                result = fn()
            except BaseException as error:  # handed to the caller through the future
                future.set_exception(error)
            else:
                future.set_result(result)
            finally:
                with self._lock:
                    self.busy_s += time.perf_counter() - start

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn))
        return future

    def abandon(self, future: Future) -> None:
        """Give up on a call that overran its bound: it may still be running (its thread stays busy until it
        returns, its result unread); a fresh thread takes its place."""
        if not future.cancel():  # running: its thread is lost to the pool
            self._threads.append(self._start())

    def close(self) -> None:
        """Stop the idle threads (a thread still inside an abandoned call ends when that call returns)."""
        for _ in self._threads:
            self.jobs.put(None)

"""engine/weights_lock.py: a trainer waiting to change the weights gets the lock at the end of the engine step in
progress, however tightly a rollout thread loops over engine steps."""

from __future__ import annotations

import threading
import time

from posttrain.engine.weights_lock import WeightsLock


def _steps_before_the_writer_gets_in(lock: WeightsLock) -> int:
    """A thread runs back-to-back 'engine steps' of ~2 ms each; the main thread then asks for the writer's side.
    Returns how many steps started between the ask and the grant."""
    steps = 0
    stop = threading.Event()
    started = threading.Event()

    def engine_loop() -> None:
        nonlocal steps
        while not stop.is_set():
            with lock.engine_step():
                steps += 1
                started.set()
                end = time.perf_counter() + 0.002
                while time.perf_counter() < end:  # a forward: holds the lock, no gap before the next step
                    pass

    thread = threading.Thread(target=engine_loop, daemon=True)
    thread.start()
    started.wait()
    time.sleep(0.02)
    asked = steps
    with lock:
        granted = steps
        with lock:  # re-entrant: weights_updated() takes it again inside the trainer's hold
            pass
    stop.set()
    thread.join(timeout=5)
    return granted - asked


def test_a_waiting_writer_goes_before_the_next_engine_step() -> None:
    # The step in progress may finish (1), and the engine may be between its wait and its acquire (2); never more.
    assert _steps_before_the_writer_gets_in(WeightsLock()) <= 2


def test_the_engine_steps_again_after_the_writer() -> None:
    lock = WeightsLock()
    with lock:
        pass
    done = threading.Event()

    def one_step() -> None:
        with lock.engine_step():
            done.set()

    threading.Thread(target=one_step, daemon=True).start()
    assert done.wait(timeout=5)

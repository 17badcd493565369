"""The cores of one process shared between the rollout thread and the update (`rollout.mode: async` in one process).

torch's intra-op thread count is a per-thread setting (torch.set_num_threads sets OpenMP's count for the calling
thread), so each side runs with its own. While both sides are busy each runs `share` threads (with 2 cores: one
each). While one side is idle (the update waiting for a batch, the rollout waiting at the staleness bound), the
other runs all `total` threads: a fixed half each would leave a core idle for the whole of the other side's wait.

Each side registers its thread once (`register`), says when it starts and stops waiting (`busy`), and calls `claim`
at its safe points (the rollout before every engine step, the update before every micro-batch and, inside
`autograd_claims`, at every tensor its forward saves and its backward reads back), where its count is set to what
the other side's state allows. `claim` from a thread that did not register is a no-op, so the engine
hook does nothing when the trainer steps the engine itself (evaluation, regenerating stale groups).

`waiting()` marks the calling thread's side idle for a stretch in which it steps no engine and runs no update: the
reward call over a collected batch as a whole (a sandbox, a remote judge, a `time.sleep`), and an episode loop
whose every episode waits on its environment worker. "Idle" is meant per side, not per core: the other side takes
every core at its next safe point, and the waiting thread keeps the count it had, so a reward that computes in
torch on that thread still runs (it shares the cores with the other side's threads for the length of the call,
over-subscribing them by its own count) rather than being starved. A reward that mostly waits hands its cores
over whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import Tensor

SIDES = ("rollout", "update")


class CoreShare:
    def __init__(self, total: int, share: int) -> None:
        if not 1 <= share <= total:
            raise ValueError(f"share must be in [1, total={total}], got {share}")
        self.total, self.share = total, share
        self._busy = dict.fromkeys(SIDES, True)
        self._sides: dict[int, str] = {}  # thread ident -> side

    def register(self, side: str) -> None:
        """The calling thread is `side` from now on; its count is set at once."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self._sides[threading.get_ident()] = side
        self.claim()

    def busy(self, side: str, flag: bool) -> None:
        self._busy[side] = flag  # one bool per side, written by its own thread only: no lock needed

    def threads_for(self, side: str) -> int:
        other = SIDES[1 - SIDES.index(side)]
        return self.share if self._busy[other] else self.total

    def claim(self) -> None:
        """Set the calling thread's torch thread count to what its side may use now."""
        side = self._sides.get(threading.get_ident())
        if side is None:
            return
        threads = self.threads_for(side)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The calling thread's side is idle inside (see the module docstring); its state before is restored after,
        and its count claimed again. A no-op in a thread that did not register."""
        side = self._sides.get(threading.get_ident())
        if side is None:
            yield
            return
        before = self._busy[side]
        self.busy(side, False)
        try:
            yield
        finally:
            self.busy(side, before)
            self.claim()

    def autograd_claims(self) -> AbstractContextManager:
        """A context in which every tensor the forward saves for the backward, and every one the backward reads
        back, first `claim`s: the update follows the other side op by op, in its forward and its backward.

        A micro-batch can last seconds (the demo's whole batch is one), and the rollout side often goes idle a
        fraction into it: claiming only per micro-batch left the update on its share of the cores for the rest of
        it. torch's saved-tensor hooks are per thread, so the rollout thread's engine is untouched; they are not
        module hooks, which would make the engine's native decode step (it skips module hooks, so it refuses
        modules that have them) fall back to the modules. The hooks pass each tensor through unchanged; a claim is
        a dict read and torch.get_num_threads() unless the count changes."""

        def passing(tensor: Tensor) -> Tensor:
            self.claim()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(passing, passing)

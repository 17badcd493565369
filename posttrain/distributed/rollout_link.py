"""Rollout processes under torchrun: the trainer rank and the ranks that only generate, and the link between them.

With `dist.rollout_ranks: M` the last M of torchrun's W ranks are rollout ranks; the first W - M train (one,
for now: rank 0, which keeps every single-process habit: it logs, checkpoints and writes the final model).
The two sides share no default process group: the trainer sees no torch.distributed at all (every helper of
`env` is the single-process no-op), and the rollout ranks form a default group of their own when there are
several (DAPO's refill decisions gather over it). Between the sides runs a `RolloutLink`: a gloo group of all
W ranks (link rank = global rank) for the rollout batches (pickled into uint8 tensors, point to point) and the
weights (broadcast from the trainer; on CUDA over an NCCL group of the same ranks).

Faults: every wait on the other side is bounded by `dist.rollout_timeout_s`; a rank that died (its sockets
closed) or hangs past that raises `RolloutRankError` naming the rank and what was awaited. torchrun itself
stops every process (SIGTERM) as soon as one exits: the trainer turns that signal into a `RolloutRankError` too
(`stop_on_sigterm`), naming the rollout ranks whose processes are gone (each sent its host and pid at the
start), so a run stops with one line saying which rank ended, wherever the trainer was (a checkpoint being
written is left unfinished, as a partial directory: the last complete one stays the last).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from posttrain.distributed.env import DistContext, launched_by_torchrun
from posttrain.errors import ConfigError, PosttrainError

_LENGTH_TAG, _PAYLOAD_TAG = 11, 12


class RolloutRankError(PosttrainError):
    """The other side of the rollout link died or did not answer within dist.rollout_timeout_s."""


@dataclass
class RolloutLink:
    rank: int  # this process's rank in torchrun's world (= its rank in the link group)
    world_size: int
    num_rollout: int
    timeout_s: float
    group: dist.ProcessGroup  # gloo, every rank
    weights_group: dist.ProcessGroup  # the group the weights go over: `group` on CPU, NCCL on CUDA
    _pending: list[Any] = field(default_factory=list)  # sends not yet known to be delivered
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)  # trainer: rollout rank -> (host, pid)

    @property
    def trainer_rank(self) -> int:
        return 0

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.world_size - self.num_rollout, self.world_size))

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def rollout_index(self) -> int:
        """This rollout rank's place among the rollout ranks (0 .. M-1)."""
        return self.rank - (self.world_size - self.num_rollout)

    @contextlib.contextmanager
    def failures(self, what: str, peer: int | None = None) -> Iterator[None]:
        """Inside: gloo's error for a peer that died or did not answer (raised when an operation is posted, if
        the peer's socket is already closed, or when it is waited for) becomes one `RolloutRankError` naming the
        peer (`peer`, else the rollout ranks whose processes are gone)."""
        try:
            yield
        except RuntimeError as error:
            cause = "timed out" if "Timed out" in str(error) else "connection lost"
            if peer is not None:
                who = f"{'rollout rank' if peer in self.rollout_ranks else 'trainer rank'} {peer}"
                if cause == "connection lost" and self._exits(peer):
                    who += f" (pid {self.peers[peer][1]}) exited"
            else:
                who = ", ".join(f"rollout rank {r}" for r in self.gone_ranks()) or "a rollout rank"
            raise RolloutRankError(
                f"{who}: {what} failed ({cause}: the process died, or hung longer than "
                f"dist.rollout_timeout_s={self.timeout_s:g}s)"
            ) from None

    def _wait(self, post: Callable[[], Any], peer: int, what: str) -> None:
        """Post a point-to-point operation (`post()` returns its work) and wait for it, bounded by the timeout."""
        with self.failures(what, peer):
            post().wait(timedelta(seconds=self.timeout_s))

    def send_object(self, obj: Any, dst: int, what: str) -> None:
        """Send a picklable `obj` to rank `dst` without waiting for it to be received (the previous send is
        waited for first, so at most one is in flight; `flush` waits for the last)."""
        self.flush(dst, what)
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # (n,)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        with self.failures(what, dst):
            self._pending = [
                self.group.send([length], dst, _LENGTH_TAG),
                self.group.send([payload], dst, _PAYLOAD_TAG),
            ]

    def flush(self, dst: int, what: str) -> None:
        pending, self._pending = self._pending, []
        for work in pending:
            self._wait(lambda w=work: w, dst, what)

    def recv_object(self, src: int, what: str) -> Any:
        """The next object rank `src` sent; waits at most dist.rollout_timeout_s for each part."""
        length = torch.zeros(1, dtype=torch.int64)
        self._wait(lambda: self.group.recv([length], src, _LENGTH_TAG), src, what)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._wait(lambda: self.group.recv([payload], src, _PAYLOAD_TAG), src, what)
        return pickle.loads(payload.numpy().tobytes())

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """The trainer's `obj` on every rank of the link (the start step and prompt-source state)."""
        if self.rank == self.trainer_rank:
            for dst in self.rollout_ranks:
                self.send_object(obj, dst, what)
                self.flush(dst, what)
            return obj
        return self.recv_object(self.trainer_rank, what)

    def introduce(self) -> None:
        """Rollout ranks: send this process's host and pid to the trainer; the trainer: receive them (`peers`)."""
        if self.is_rollout:
            self.send_object((socket.gethostname(), os.getpid()), self.trainer_rank, "introducing this rank")
            self.flush(self.trainer_rank, "introducing this rank")
            return
        for rank in self.rollout_ranks:
            self.peers[rank] = self.recv_object(rank, "its introduction")

    def gone_ranks(self) -> list[int]:
        """The rollout ranks on this host whose processes have exited (gone, or not yet reaped)."""
        host = socket.gethostname()
        return [rank for rank, (peer_host, pid) in self.peers.items() if peer_host == host and not _running(pid)]

    def _exits(self, peer: int, within_s: float = 1.0) -> bool:
        """Whether rollout rank `peer` (on this host) has exited or exits within `within_s`: its sockets close as
        it exits, so gloo may report the lost connection a moment before the process is a zombie."""
        if peer not in self.peers:
            return False
        deadline = time.monotonic() + within_s
        while peer not in self.gone_ranks():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    @contextlib.contextmanager
    def stop_on_sigterm(self, on_stop: Callable[[], None]) -> Iterator[None]:
        """Inside (the trainer's main thread): torchrun's SIGTERM calls `on_stop` and raises `RolloutRankError`
        naming the rollout ranks that are gone. Elsewhere (another thread) a no-op."""

        def stopped(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGTERM, previous)  # once: a second signal ends the process as before
            on_stop()
            gone = [f"rollout rank {r} (pid {self.peers[r][1]}) exited" for r in self.gone_ranks()]
            what = "; ".join(gone) if gone else "another process of the run exited"
            raise RolloutRankError(f"{what}; torchrun stopped the run (see its report for the exit code)")

        try:
            previous = signal.signal(signal.SIGTERM, stopped)
        except ValueError:  # not the main thread
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def join_with_rollout_ranks(num_rollout: int, timeout_s: float, device_type: str) -> tuple[DistContext, RolloutLink]:
    """Under torchrun with `num_rollout` rollout ranks: this process's context on its side (the trainer: a
    single process; a rollout rank: its place in the rollout ranks' own default group) and the link."""
    if not launched_by_torchrun():
        raise ConfigError(
            f"dist.rollout_ranks={num_rollout} runs rollout processes under torchrun: launch with "
            f"`--nproc {num_rollout + 1}` (one trainer process and {num_rollout} rollout processes)"
        )
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if world - num_rollout != 1:
        raise ConfigError(
            f"dist.rollout_ranks={num_rollout} with {world} processes leaves {world - num_rollout} trainer "
            f"processes; rollout processes train on exactly one: launch with --nproc {num_rollout + 1}"
        )
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    store, _, _ = next(dist.rendezvous("env://"))
    timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroupGloo(dist.PrefixStore("rollout_link", store), rank, world, timeout)
    weights_group = group
    if device_type == "cuda":
        weights_group = dist.ProcessGroupNCCL(dist.PrefixStore("rollout_weights", store), rank, world)
    link = RolloutLink(rank, world, num_rollout, timeout_s, group, weights_group)
    if not link.is_rollout:
        return DistContext(), link
    index = link.rollout_index
    if num_rollout > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=dist.PrefixStore("rollout_ranks", store), rank=index, world_size=num_rollout
        )
    return DistContext(index, num_rollout, local_rank), link


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, exited but not yet reaped by torchrun, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the field after the command name, which may hold spaces
    except (OSError, IndexError):  # no /proc (not Linux): existing is all we know
        return True
    return state != "Z"

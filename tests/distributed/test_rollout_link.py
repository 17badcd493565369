"""RolloutLink's fault handling without a second process: a gloo group stand-in that fails the way gloo does when
the peer is gone (raising as the operation is posted, if the socket is already closed, or when it is waited for).
Whichever way, the caller gets one RolloutRankError naming the rank and what was awaited (the torchrun tests of
test_rollout_procs_parallel.py cannot choose which of the two a real dead peer gives)."""

from __future__ import annotations

import pytest

from posttrain.distributed.rollout_link import RolloutLink, RolloutRankError

CLOSED = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:43714"


class _FailedWork:
    def __init__(self, message: str) -> None:
        self.message = message

    def wait(self, timeout) -> None:  # noqa: ANN001
        raise RuntimeError(self.message)


class _Group:
    """recv/send raise at once (`at="post"`) or return work whose wait raises (`at="wait"`)."""

    def __init__(self, at: str, message: str = CLOSED) -> None:
        self.at, self.message = at, message

    def _op(self, *args) -> _FailedWork:  # noqa: ANN002
        if self.at == "post":
            raise RuntimeError(self.message)
        return _FailedWork(self.message)

    recv = send = _op


def _trainer_link(group: _Group) -> RolloutLink:
    return RolloutLink(rank=0, world_size=2, num_rollout=1, timeout_s=5, group=group, weights_group=group)


@pytest.mark.parametrize("at", ["post", "wait"])
def test_a_dead_rollout_rank_is_one_error_naming_it_whenever_gloo_notices(at):
    link = _trainer_link(_Group(at))
    with pytest.raises(RolloutRankError, match=r"^rollout rank 1: the rollout of step 3 failed \(connection lost"):
        link.recv_object(1, "the rollout of step 3")
    with pytest.raises(RolloutRankError, match=r"^rollout rank 1: sending the start failed"):
        link.send_object({"start": 0}, 1, "sending the start")
        link.flush(1, "sending the start")


def test_a_timeout_says_so_and_names_the_bound():
    link = _trainer_link(_Group("wait", "Timed out waiting 5000ms for recv operation to complete"))
    with pytest.raises(RolloutRankError, match=r"timed out: .*dist.rollout_timeout_s=5s"):
        link.recv_object(1, "the rollout of step 1")


def test_a_broadcast_without_one_peer_names_the_ranks_that_are_gone(monkeypatch):
    link = _trainer_link(_Group("post"))
    monkeypatch.setattr(link, "gone_ranks", lambda: [1])
    with pytest.raises(RolloutRankError, match=r"^rollout rank 1: the weights' broadcast after step 2 failed"):
        with link.failures("the weights' broadcast after step 2"):
            raise RuntimeError(CLOSED)
    monkeypatch.setattr(link, "gone_ranks", lambda: [])
    with pytest.raises(RolloutRankError, match=r"^a rollout rank: "):
        with link.failures("the weights' broadcast after step 2"):
            raise RuntimeError(CLOSED)


def test_a_lost_connection_to_a_rollout_process_that_exited_says_it_exited():
    """gloo reports the closed socket as the peer exits, a moment before it is a zombie torchrun has not reaped:
    a peer on this host that has exited (or does within a second) is named with its pid and 'exited'."""
    import socket
    import subprocess
    import sys

    link = _trainer_link(_Group("wait"))
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # exits at once; not waited for: a zombie
    link.peers[1] = (socket.gethostname(), child.pid)
    try:
        with pytest.raises(RolloutRankError, match=rf"^rollout rank 1 \(pid {child.pid}\) exited: the rollout of"):
            link.recv_object(1, "the rollout of step 3")
        assert link.gone_ranks() == [1]
    finally:
        child.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    link.peers[1] = (socket.gethostname(), alive.pid)
    try:
        with pytest.raises(RolloutRankError, match=r"^rollout rank 1: the rollout of step 3 failed \(connection lost"):
            link.recv_object(1, "the rollout of step 3")
        assert link.gone_ranks() == []
    finally:
        alive.kill()
        alive.wait()

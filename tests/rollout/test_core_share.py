"""The cores of one process shared between the rollout thread and the update: each side's torch thread count
follows whether the other side is busy, per thread, and a thread that did not register is left alone."""

from __future__ import annotations

import threading

import pytest
import torch

from posttrain.rollout.core_share import CoreShare


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_each_side_takes_every_core_while_the_other_waits() -> None:
    cores = CoreShare(total=4, share=2)
    seen: dict[str, list[int]] = {"rollout": []}
    rollout_ready, update_waits, done = threading.Event(), threading.Event(), threading.Event()

    def rollout() -> None:
        cores.register("rollout")
        seen["rollout"].append(torch.get_num_threads())  # both busy: its share
        rollout_ready.set()
        update_waits.wait()
        cores.claim()  # the next engine step, while the update waits for a batch
        seen["rollout"].append(torch.get_num_threads())
        cores.busy("rollout", False)  # at the staleness bound
        done.set()

    cores.register("update")
    assert torch.get_num_threads() == 2
    thread = threading.Thread(target=rollout)
    thread.start()
    rollout_ready.wait()
    cores.busy("update", False)
    update_waits.set()
    done.wait()
    thread.join()
    cores.busy("update", True)
    cores.claim()  # the update's next minibatch, the rollout waiting at the bound
    assert torch.get_num_threads() == 4
    assert seen["rollout"] == [2, 4]  # and its count never leaked into this thread (checked above: 2 then 4)


def test_an_unregistered_thread_is_left_alone() -> None:
    torch.set_num_threads(3)
    cores = CoreShare(total=4, share=1)
    cores.claim()  # the trainer stepping the engine itself (no side registered in this thread)
    assert torch.get_num_threads() == 3


def test_bad_shares_are_refused() -> None:
    with pytest.raises(ValueError, match="share must be in"):
        CoreShare(total=2, share=3)
    with pytest.raises(ValueError, match="side must be one of"):
        CoreShare(total=2, share=1).register("trainer")

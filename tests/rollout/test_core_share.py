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


def test_the_update_follows_the_rollout_op_by_op_in_forward_and_backward() -> None:
    cores = CoreShare(total=4, share=2)
    cores.register("update")
    x = torch.full((3,), 2.0, requires_grad=True)
    backward_seen: list[int] = []
    x.register_hook(lambda grad: backward_seen.append(torch.get_num_threads()))
    with cores.autograd_claims():
        y = x * x  # saves x for the backward: a claim, the rollout busy
        assert torch.get_num_threads() == 2
        cores.busy("rollout", False)  # the rollout goes idle mid-forward
        loss = (y * y).sum()  # saves y: the update takes every core at once
        assert torch.get_num_threads() == 4
        cores.busy("rollout", True)  # the rollout starts the next batch before the backward
        loss.backward()  # reading y and x back: the cores given back before the first op's backward
    assert backward_seen == [2]
    assert torch.equal(x.grad, torch.full((3,), 32.0))  # d(x^4)/dx = 4 x^3: the hooks pass tensors unchanged

    cores.busy("rollout", False)
    (x * x).sum().backward()
    assert torch.get_num_threads() == 2  # outside the context: no claims


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

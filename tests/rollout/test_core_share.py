"""The cores of one process shared between the rollout thread and the update: each side's torch thread count
follows whether the other side is busy, per thread, and a thread that did not register is left alone."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

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


class _Probe(nn.Module):
    """A layer that records the thread count its forward runs with."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return x * 2


def test_the_update_follows_the_rollout_layer_by_layer_in_forward_and_backward() -> None:
    cores = CoreShare(total=4, share=2)
    cores.register("update")
    forward_seen: list[int] = []
    layers = [_Probe(forward_seen) for _ in range(3)]
    layers[0].register_forward_hook(lambda *_: cores.busy("rollout", False))  # the rollout goes idle mid-forward
    remove = cores.claim_per_layer(layers)
    x = torch.ones(2, requires_grad=True)
    out = nn.Sequential(*layers)(x).sum()
    assert forward_seen == [2, 4, 4]  # from the layer after the rollout went idle, every core
    cores.busy("rollout", True)  # the rollout starts the next batch before the backward
    backward_seen: list[int] = []
    x.register_hook(lambda grad: backward_seen.append(torch.get_num_threads()))
    out.backward()
    assert backward_seen == [2]  # the backward's first layer gave the cores back
    assert torch.equal(x.grad, torch.full((2,), 8.0))  # the hooks leave the gradient alone

    remove()
    cores.busy("rollout", False)
    forward_seen.clear()
    nn.Sequential(*layers)(x).sum().backward()
    assert forward_seen == [2, 2, 2]  # no claims once removed (the count stays the share)


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

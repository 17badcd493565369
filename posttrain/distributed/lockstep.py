"""Rollout-engine forwards in lockstep over the ranks, for `dist.rollout_weights=per_layer`.

With the weights gathered layer by layer, each engine forward all-gathers every decoder layer's shards in
FSDP2's pre-forward hooks: collectives, which every rank must issue the same number of times, in the same
order. The ranks' rollouts do not take the same number of engine steps (other prompts, other lengths, an
early end of text), so around each engine call (`llm.generate`):

  - before each of its forwards, a rank all-reduces "I have work" (one int: the first layer's pre-forward
    hook, registered ahead of FSDP2's gather);
  - once its own requests are done, it keeps all-reducing "no work" and, while some rank still has work,
    runs an idle forward: every layer gathered and freed in forward order, the collectives of a forward
    without its compute, so no tokens, no KV slots and no sampling are involved.

Both sides meet in the same all-reduce each step; the call returns on every rank after the step in which
no rank had work left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Lockstep:
    """Keeps the engine calls of every rank in step. `layers`: the decoder layers, each its own FSDP2 group
    with resharding after forward on; none (`Lockstep.off()`): every call runs as is (whole weights)."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device) -> None:
        self.layers = list(layers)
        self.device = device  # of the flag tensor: nccl reduces CUDA tensors only
        self.idle_forwards = 0  # forwards this rank ran without work, since construction

    @classmethod
    def off(cls) -> Lockstep:
        return cls([], torch.device("cpu"))

    @property
    def active(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Around one engine call on every rank, together (collective)."""
        if not self.active:
            yield
            return
        # prepend: before FSDP2's own pre-forward, so the flag's all-reduce comes before the layer's all-gather
        # on every rank, working or idle.
        handle = self.layers[0].register_forward_pre_hook(self._working, prepend=True)
        try:
            yield
        finally:
            handle.remove()
        # Not on an error: that rank fails, and torchrun stops the others (which would wait here forever).
        while self._any_rank_working(False):
            self._idle_forward()

    def _any_rank_working(self, working: bool) -> bool:
        flag = torch.tensor([int(working)], dtype=torch.int32, device=self.device)  # (1,)
        dist.all_reduce(flag)  # the sum over the ranks: how many still have work
        return bool(flag.item())

    def _working(self, module: nn.Module, args: Any) -> None:
        self._any_rank_working(True)

    def _idle_forward(self) -> None:
        # The gathers a forward's hooks would make, layer by layer, each freed before the next: the same
        # collectives (same groups, same order, same sizes) at the same peak memory, with nothing computed.
        self.idle_forwards += 1
        for layer in self.layers:
            layer.unshard()  # type: ignore[operator]  # FSDPModule: all-gather this layer's shards
            layer.reshard()  # type: ignore[operator]

"""Contiguous copies of the decoding sequences' suffix K/V, carried from one engine step to the next.

For the PyTorch version of the CPU decode attention, which runs where the native kernel of
posttrain/kernels (it reads the pool directly) is not built or not taken. That version attends
each sequence's suffix blocks (those after the prefix its group shares) as one (Sd, Hkv, L, D) tensor.
Gathering the blocks into such a tensor every layer of every step reads and writes all the suffix K/V
once more than the attention itself does: at 512 sequences and 128 generated tokens that gather cost as
much as the attention (7.7 vs 6.0 ms a layer; index_select was 17% of a whole rollout's CPU time, matmuls
54%).

Between two decode steps of the same sequences only one token per sequence is new. So each layer keeps
its gathered suffixes in a buffer with room to grow (`SLACK_BLOCKS`), and a step that extends the
previous one writes just the new token's K/V into it. Anything else (a sequence joined, left, forked or
was preempted, a suffix outgrew the room, another KV pool ran in between) gathers afresh.

A step "extends" the previous one when the KV pool is the same, the decode sequences are the same
count with the same shared-prefix lengths, each suffix is exactly one token longer, and each
sequence's previous suffix blocks are the leading blocks of its new suffix. The blocks a sequence
holds are written only at its new positions while it holds them, so the staged copy of the older
positions is still what the pool has.

Memory: the buffers hold the decoding sequences' suffix K/V once more (all layers), never more than
the KV pool itself; when they would, the step gathers as before. `release()` frees them; the engine
calls it whenever it has no request left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

SLACK_BLOCKS = 4  # room to grow, in blocks per sequence, before a staged buffer is gathered again


@dataclass
class StagingPlan:
    key: int  # this step's identity
    extends: int | None  # the key of the previous step when this one only adds a token per sequence
    capacity: int  # tokens per sequence in the buffers
    width: int  # tokens per sequence this step attends (its suffix blocks x block size)
    rows: torch.Tensor  # (Sd,) 0..Sd-1
    newest: torch.Tensor  # (Sd,) where each sequence's newest token sits in its suffix


@dataclass
class _Previous:
    pool: tuple[int, tuple[int, ...]]  # data pointer and shape of layer 0's cache
    key: int
    capacity: int
    blocks: torch.Tensor  # (Sd, Bs) suffix blocks
    lengths: list[int]  # suffix tokens per sequence
    shared: list[int]  # shared prefix blocks per sequence


class SuffixStaging:
    """The previous step's decode layout, and one staged buffer per layer (held by a PagedWorkspace)."""

    def __init__(self) -> None:
        self.previous: _Previous | None = None
        self.buffers: dict[int, tuple[int, torch.Tensor]] = {}  # layer -> (plan key, (2, Sd, cap, Hkv, D))
        self._keys = itertools.count(1)

    def release(self) -> None:
        self.previous = None
        self.buffers.clear()

    def plan(
        self,
        kv_caches: list[torch.Tensor],
        blocks: torch.Tensor,
        lengths: list[int],
        shared: list[int],
        block_size: int,
    ) -> StagingPlan | None:
        """The staging of this step's decode sequences (blocks (Sd, Bs) suffix blocks padded with 0,
        lengths their suffix tokens); None when the buffers would outgrow the KV pool."""
        cache = kv_caches[0]
        pool = (cache.data_ptr(), tuple(cache.shape))
        prev = self.previous
        extends = None
        capacity = (-(-max(lengths) // block_size) + SLACK_BLOCKS) * block_size
        if (
            prev is not None
            and prev.pool == pool
            and prev.shared == shared
            and len(prev.lengths) == len(lengths)
            and max(lengths) <= prev.capacity
            and all(n == p + 1 for n, p in zip(lengths, prev.lengths))
            and self._same_leading_blocks(prev, blocks, block_size)
        ):
            extends, capacity = prev.key, prev.capacity
        per_token = cache[:, 0, 0].numel() * cache.element_size()  # K and V of one token, one layer
        staged_bytes = len(lengths) * capacity * per_token * len(kv_caches)
        if staged_bytes > sum(c.numel() * c.element_size() for c in kv_caches):
            self.release()
            return None
        key = next(self._keys)
        self.previous = _Previous(pool, key, capacity, blocks, list(lengths), list(shared))
        device = blocks.device
        return StagingPlan(
            key,
            extends,
            capacity,
            blocks.shape[1] * block_size,
            torch.arange(len(lengths), device=device),
            torch.tensor(lengths, device=device) - 1,
        )

    @staticmethod
    def _same_leading_blocks(prev: _Previous, blocks: torch.Tensor, block_size: int) -> bool:
        width = prev.blocks.shape[1]
        if blocks.shape[1] < width:
            return False
        used = torch.arange(width)[None, :] * block_size < torch.tensor(prev.lengths)[:, None]  # (Sd, Bs_prev)
        return bool(((blocks[:, :width] == prev.blocks) | ~used.to(blocks.device)).all())

    def append(
        self, layer: int, plan: StagingPlan, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """When this layer's buffer holds the previous step's suffixes and this step extends it: write the
        decode sequences' newest K/V (Sd, Hkv, D), in plan order, and return the suffix K and V as
        (Sd, Hkv, L, D) views of the buffer (L = `width` tokens). Otherwise None: gather, then `store`."""
        held = self.buffers.get(layer)
        if plan.extends is None or held is None or held[0] != plan.extends:
            return None
        buffer = held[1]
        buffer[0].index_put_((plan.rows, plan.newest), k_new.to(buffer.dtype))
        buffer[1].index_put_((plan.rows, plan.newest), v_new.to(buffer.dtype))
        self.buffers[layer] = (plan.key, buffer)
        view = buffer[:, :, : plan.width]  # (2, Sd, L, Hkv, D)
        return view[0].transpose(1, 2), view[1].transpose(1, 2)

    def store(self, layer: int, plan: StagingPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep this step's gathered suffixes k, v (Sd, Hkv, L, D) as this layer's buffer for the next step."""
        Sd, hkv, L, d = k.shape
        shape = (2, Sd, plan.capacity, hkv, d)
        held = self.buffers.pop(layer, None)
        if held is not None and held[1].shape == shape and held[1].dtype == k.dtype:
            buffer = held[1]
        else:
            # Zeros: positions past a suffix are masked, but a masked NaN would still poison the sums.
            buffer = torch.zeros(shape, dtype=k.dtype, device=k.device)
        buffer[0, :, :L] = k.transpose(1, 2)
        buffer[1, :, :L] = v.transpose(1, 2)
        self.buffers[layer] = (plan.key, buffer)

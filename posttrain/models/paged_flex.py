"""Paged attention through PyTorch's FlexAttention (torch.nn.attention.flex_attention), reading K/V where
they lie in the pool: no gather, no padded copy of each sequence's context.

Layout: the step's N new tokens are one query "sequence" (1, H, N, D), the whole pool of a layer is one
key/value sequence (1, Hkv, num_blocks * block_size, D), and two things say who sees what:

- the mask_mod (exact, per element): query token t, of sequence s at position p, sees pool slot
  (block b, offset o) when b is in s's block table at the logical index i = block_index[b] and the
  slot's position i * block_size + o is at most p (and less than the window behind it).
  `block_index` is one number per pool block, not a (sequences, blocks) inverse table: a block's K/V
  carry their positions (RoPE), so every table that lists a block lists it at the same index (the
  engine shares blocks only as common prefixes).
- the BlockMask (sparsity, what a fused kernel loads): for each tile of Q_TILE consecutive query tokens,
  the deduplicated pool blocks their tables list up to their positions. The n samples of a prompt sit
  next to each other, so their shared prompt blocks are loaded once per tile.

On CUDA the call is torch.compile'd into FlexAttention's Triton kernel, which visits only the listed
blocks and evaluates the mask_mod inside them. Elsewhere it runs FlexAttention's unfused eager path, which
ignores the block lists and masks the whole (N, pool) score matrix, here with the same rule evaluated once
per step as a dense mask: on CPU a correctness oracle, not a fast path (the tests check the block lists on
their own against the rule, tests/engine/test_paged_flex.py).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from posttrain.models.attention_metadata import PagedAttentionMetadata

Q_TILE = 16  # query tokens per BlockMask row: the smallest tile of the Triton kernel


@dataclass
class FlexPlan:
    """What every layer of one step shares (per sliding window): the BlockMask and its mask_mod."""

    block_mask: BlockMask
    kernel_options: dict[str, int | str]
    mask_mod: Callable[..., torch.Tensor]  # the arithmetic rule (module docstring), whichever the BlockMask holds


def flex_paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: PagedAttentionMetadata, sliding_window: int | None
) -> torch.Tensor:
    """q (N, H, D), cache (2, num_blocks, block_size, Hkv, D) with this step's K/V written -> (N, H, D)."""
    N, H, D = q.shape
    _, num_blocks, block_size, hkv, _ = cache.shape
    plan = meta.cached_plan(
        ("flex", sliding_window), lambda: build_flex_plan(meta, num_blocks, block_size, sliding_window)
    )
    pool = cache.view(2, 1, num_blocks * block_size, hkv, D).transpose(2, 3)  # (2, 1, Hkv, slots, D): a view
    keys, values = pool[0], pool[1]
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    out = _flex_fn(q.is_cuda)(
        q.transpose(0, 1).unsqueeze(0),  # (1, H, N, D)
        keys,
        values,
        block_mask=plan.block_mask,
        enable_gqa=H != hkv,
        kernel_options=plan.kernel_options or None,
    )  # (1, H, N, D)
    return out[0].transpose(0, 1)  # (N, H, D)


def build_flex_plan(
    meta: PagedAttentionMetadata, num_blocks: int, block_size: int, sliding_window: int | None
) -> FlexPlan:
    """The step's BlockMask and mask_mod, from the metadata alone and without a host sync (it runs inside
    CUDA graph capture too)."""
    tables = meta.block_tables  # (S, W)
    device = tables.device
    S, W = tables.shape
    N = meta.slot_mapping.shape[0]
    query_lens, context_lens = meta.query_lens, meta.context_lens
    seq = torch.repeat_interleave(torch.arange(S, device=device), query_lens, output_size=N)  # (N,)
    starts = torch.cumsum(query_lens, 0) - query_lens  # (S,) first row of each sequence
    q_pos = (context_lens - query_lens)[seq] + torch.arange(N, device=device) - starts[seq]  # (N,)
    block_index = logical_block_index(tables, context_lens, num_blocks, block_size)  # (num_blocks,)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        s, p = seq[q_idx], q_pos[q_idx]
        block = kv_idx // block_size
        index = block_index[block]
        k_pos = index * block_size + kv_idx % block_size
        visible = (tables[s, index] == block) & (k_pos <= p)
        if sliding_window is not None:
            visible = visible & (p - k_pos < sliding_window)
        return visible

    kv_num_blocks, kv_indices = tile_block_lists(tables, seq, q_pos, num_blocks, block_size, sliding_window)
    cuda = device.type == "cuda"
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],  # (1, 1, R)
        kv_indices[None, None],  # (1, 1, R, Q_TILE * W)
        BLOCK_SIZE=(Q_TILE, block_size),
        mask_mod=mask_mod if cuda else _lookup(mask_mod, N, num_blocks * block_size, device),
        seq_lengths=(N, num_blocks * block_size),
        compute_q_blocks=False,  # forward only: no transposed lists for a backward pass
    )
    return FlexPlan(block_mask, kernel_options(block_size) if cuda else {}, mask_mod)


def _lookup(mask_mod: Callable[..., torch.Tensor], N: int, num_slots: int, device: torch.device) -> Callable:
    """For the eager path: the same rule evaluated once over all (N, num_slots) pairs by broadcasting, then
    looked up. Eager FlexAttention vmaps the mask_mod over every pair, which costs ~10x the attention here."""
    zero = torch.zeros((), dtype=torch.long, device=device)
    rows = torch.arange(N, device=device)[:, None]
    dense = mask_mod(zero, zero, rows, torch.arange(num_slots, device=device)[None, :])  # (N, num_slots)

    def lookup(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return dense[q_idx, kv_idx]

    return lookup


def logical_block_index(
    tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """(num_blocks,) the index at which the tables list each pool block (0 for blocks no table lists).
    Only the entries a sequence uses count: the padding of a table (block 0) and blocks past its context."""
    S, W = tables.shape
    logical = torch.arange(W, device=tables.device)
    used = logical[None, :] < (context_lens[:, None] + block_size - 1) // block_size  # (S, W)
    target = torch.where(used, tables, num_blocks)  # unused entries land in a spare last slot
    index = torch.zeros(num_blocks + 1, dtype=torch.long, device=tables.device)
    index.scatter_(0, target.reshape(-1), logical.expand(S, W).reshape(-1))
    return index[:num_blocks]


def tile_block_lists(
    tables: torch.Tensor,
    seq: torch.Tensor,
    q_pos: torch.Tensor,
    num_blocks: int,
    block_size: int,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each tile of Q_TILE query tokens, the distinct pool blocks any of them may see, in increasing
    order: kv_num_blocks (R,) int32 and kv_indices (R, Q_TILE * W) int32, R = ceil(N / Q_TILE). Sorting,
    not a (R, num_blocks) table, removes the repeats, so the memory stays O(N * W)."""
    W = tables.shape[1]
    N = seq.shape[0]
    logical = torch.arange(W, device=tables.device)
    last = q_pos // block_size  # (N,) a token sees its table up to its own block ...
    wanted = logical[None, :] <= last[:, None]  # (N, W)
    if sliding_window is not None:  # ... and from the block of its oldest key in the window
        first = (q_pos - sliding_window + 1).clamp(min=0) // block_size
        wanted &= logical[None, :] >= first[:, None]
    none = num_blocks  # sorts after every real block
    entries = torch.where(wanted, tables[seq], none)  # (N, W)
    R = -(-N // Q_TILE)
    if R * Q_TILE != N:
        entries = torch.cat([entries, entries.new_full((R * Q_TILE - N, W), none)])
    entries = entries.view(R, Q_TILE * W).sort(dim=1).values
    repeat = torch.cat([entries.new_zeros(R, 1, dtype=torch.bool), entries[:, 1:] == entries[:, :-1]], dim=1)
    entries = torch.where(repeat, none, entries).sort(dim=1).values  # distinct blocks first, then `none`
    listed = entries < none
    kv_num_blocks = listed.sum(dim=1, dtype=torch.int32)  # (R,)
    kv_indices = torch.where(listed, entries, 0).to(torch.int32)  # (R, Q_TILE * W)
    return kv_num_blocks, kv_indices


def kernel_options(block_size: int) -> dict[str, int | str]:
    """Triton tiles that divide the BlockMask's (Q_TILE, block_size) blocks: FlexAttention refuses tiles
    that straddle two blocks, and its defaults (64-128 keys) are wider than a 16-token KV block."""
    # TRITON: the general kernel; the decoding one takes neither per-tile block lists nor a GQA group of 3.
    return {"BACKEND": "TRITON", "BLOCK_M": Q_TILE, "BLOCK_N": math.gcd(block_size, 64)}


def _flex_fn(cuda: bool) -> Callable[..., torch.Tensor]:
    """torch.compile'd FlexAttention on CUDA (the fused kernel), the eager (unfused) call elsewhere."""
    return _compiled_flex() if cuda else _eager_flex


def _eager_flex(*args: Any, **kwargs: Any) -> torch.Tensor:
    """FlexAttention uncompiled, without its warning that it is uncompiled: off CUDA that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, fullgraph=True)

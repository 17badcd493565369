"""The FlexAttention paged kernel (posttrain/models/paged_flex.py) against the reference, on CPU.

On CPU FlexAttention runs its eager path, which applies the mask_mod to every (query, pool slot) pair and
ignores the BlockMask's block lists. The lists are what the fused CUDA kernel visits, so they are checked
here on their own: attention restricted to the listed blocks (as the kernel computes it) equals the
reference, and no list holds a block twice or one outside its tile's tables.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from posttrain.models.attention import PagedAttentionMetadata
from posttrain.models.paged_attention import paged_attention, reference_paged_attention
from posttrain.models.paged_flex import Q_TILE, build_flex_plan
from tests.engine.test_paged_attention import BS, HKV, D, _layout
from tests.numeric import assert_reordered, reorder_rtol

NUM_BLOCKS = 120
# Each output entry passes through the q.k dot products, the softmax's exponentials (one rounding each, counted
# as one more sum), its normaliser and the weighted sum of the values: 4 sums of at most a pool's slots.
ATTENTION_RTOL = reorder_rtol(4, NUM_BLOCKS * BS)


def _step(seed: int, kind: str, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """One step of the engine's shapes: sample groups sharing prompt blocks, strangers sharing a 'system
    prompt' block, singletons; rows decoding, prefilling, or both (kind)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tables, ctx, qlens = _layout(rng, NUM_BLOCKS)
    if kind == "decode":
        qlens = [1] * len(qlens)
    elif kind == "prefill":
        qlens = [min(c, rng.randint(2, 9)) for c in ctx]
    width = max(len(t) for t in tables)
    slots = [t[p // BS] * BS + p % BS for t, c, n in zip(tables, ctx, qlens) for p in range(c - n, c)]
    N = len(slots)
    q, k, v = torch.randn(N, heads, D), torch.randn(N, HKV, D), torch.randn(N, HKV, D)
    meta = PagedAttentionMetadata(
        [torch.randn(2, NUM_BLOCKS, BS, HKV, D)],
        torch.tensor(slots),
        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor(ctx),
        torch.tensor(qlens),
        max(qlens),
    )
    return q, k, v, meta


def _with(meta: PagedAttentionMetadata, backend: str) -> PagedAttentionMetadata:
    """The same step on a fresh copy of the pool, attended by `backend`."""
    return PagedAttentionMetadata(
        [c.clone() for c in meta.kv_caches],
        meta.slot_mapping,
        meta.block_tables,
        meta.context_lens,
        meta.query_lens,
        meta.max_query_len,
        backend=backend,
    )


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [6, HKV])  # grouped-query and plain multi-head
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("seed", range(2))
def test_flex_matches_reference(seed: int, kind: str, heads: int, window: int | None) -> None:
    q, k, v, meta = _step(seed, kind, heads)
    flex_meta, ref_meta = _with(meta, "flex"), _with(meta, "reference")
    out = paged_attention(q, k, v, flex_meta, 0, window)
    expected = reference_paged_attention(q, k, v, ref_meta, 0, window)
    assert_reordered(out, expected, ATTENTION_RTOL)
    assert torch.equal(flex_meta.kv_caches[0], ref_meta.kv_caches[0])  # the same K/V writes


def _listed_mask(plan, N: int, num_slots: int) -> torch.Tensor:
    """(N, num_slots) bool: the slots of the blocks listed for each query token's tile."""
    kv_num = plan.block_mask.kv_num_blocks[0, 0]  # (R,)
    kv_idx = plan.block_mask.kv_indices[0, 0].long()  # (R, cols)
    R = kv_num.shape[0]
    blocks = torch.zeros(R, num_slots // BS, dtype=torch.bool)
    for r in range(R):
        listed = kv_idx[r, : int(kv_num[r])]
        assert listed.unique().numel() == listed.numel(), f"tile {r} lists a block twice"
        blocks[r, listed] = True
    per_token = blocks.repeat_interleave(Q_TILE, dim=0)[:N]  # (N, num_blocks)
    return per_token.repeat_interleave(BS, dim=1)  # (N, num_slots)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("seed", range(3))
def test_block_lists_hold_every_visible_block(seed: int, kind: str, window: int | None) -> None:
    """What the fused kernel computes (the mask_mod, on the listed blocks only) equals the reference, and
    each tile lists only blocks of its own tokens' tables."""
    q, k, v, meta = _step(seed, kind, 6)
    ref_meta = _with(meta, "reference")
    expected = reference_paged_attention(q, k, v, ref_meta, 0, window)
    cache = ref_meta.kv_caches[0]  # K/V written
    plan = build_flex_plan(meta, NUM_BLOCKS, BS, window)
    N, num_slots = q.shape[0], NUM_BLOCKS * BS
    listed = _listed_mask(plan, N, num_slots)
    b = torch.zeros((), dtype=torch.long)
    mask = torch.stack(
        [plan.mask_mod(b, b, torch.tensor(t), torch.arange(num_slots)) for t in range(N)]
    )  # (N, num_slots)
    keys = cache[0].reshape(num_slots, HKV, D).transpose(0, 1)[None]  # (1, Hkv, slots, D)
    values = cache[1].reshape(num_slots, HKV, D).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=(mask & listed)[None, None], enable_gqa=True
    )[0].transpose(0, 1)  # (N, H, D)
    assert_reordered(out, expected, ATTENTION_RTOL)
    # No stray blocks: a tile lists only blocks of the tables of the sequences its tokens belong to.
    seq = torch.repeat_interleave(torch.arange(meta.query_lens.shape[0]), meta.query_lens)
    for r in range(plan.block_mask.kv_num_blocks.shape[-1]):
        own = set(meta.block_tables[seq[r * Q_TILE : (r + 1) * Q_TILE]].flatten().tolist())
        listed_blocks = plan.block_mask.kv_indices[0, 0, r, : int(plan.block_mask.kv_num_blocks[0, 0, r])]
        assert set(listed_blocks.tolist()) <= own


def test_block_lists_follow_causality_and_window() -> None:
    """One prefilling sequence of 40 tokens in 10 blocks: a tile lists the blocks up to its last token's,
    and with a window only from its first token's oldest key on."""
    tables = torch.tensor([[7, 3, 9, 1, 4, 8, 2, 6, 5, 0]])
    meta = PagedAttentionMetadata(
        [torch.zeros(2, 10, BS, HKV, D)], torch.arange(40), tables, torch.tensor([40]), torch.tensor([40]), 40
    )
    lists = build_flex_plan(meta, 10, BS, None).block_mask
    windowed = build_flex_plan(meta, 10, BS, 6).block_mask
    for r, (first, last) in enumerate([(0, 15), (16, 31), (32, 39)]):  # token rows of each tile
        want = set(tables[0, : last // BS + 1].tolist())
        assert set(lists.kv_indices[0, 0, r, : int(lists.kv_num_blocks[0, 0, r])].tolist()) == want
        oldest = max(0, first - 6 + 1)
        want = set(tables[0, oldest // BS : last // BS + 1].tolist())
        assert set(windowed.kv_indices[0, 0, r, : int(windowed.kv_num_blocks[0, 0, r])].tolist()) == want

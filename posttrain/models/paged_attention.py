"""Attention over a paged KV cache: write the new tokens' K/V into their slots, then attend over each
sequence's blocks. Pure PyTorch (SDPA), so it runs on CPU and GPU alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.models.attention import PagedAttentionMetadata


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (2, num_blocks, block_size, Hkv, D); k, v (N, Hkv, D); slots < 0 are skipped."""
    flat = cache.view(2, -1, *cache.shape[-2:])  # (2, num_slots, Hkv, D)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, k.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PagedAttentionMetadata,
    layer_idx: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q (N, H, D), k/v (N, Hkv, D) for the new tokens -> attention output (N, H, D)."""
    cache = meta.kv_caches[layer_idx]
    write_kv(cache, k, v, meta.slot_mapping)
    S, max_blocks = meta.block_tables.shape
    block_size = cache.shape[2]
    L = max_blocks * block_size
    keys = cache[0][meta.block_tables].view(S, L, *cache.shape[-2:]).transpose(1, 2)  # (S, Hkv, L, D)
    values = cache[1][meta.block_tables].view(S, L, *cache.shape[-2:]).transpose(1, 2)
    Q = meta.max_query_len
    if Q == 1:
        queries = q.unsqueeze(2)  # (S, H, 1, D)
    else:
        queries = _pad_queries(q, meta.query_lens, Q)  # (S, H, Q, D)
    # Query i of sequence s sits at absolute position context_len - query_len + i.
    q_pos = (meta.context_lens - meta.query_lens)[:, None] + torch.arange(Q, device=q.device)[None]  # (S, Q)
    k_pos = torch.arange(L, device=q.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, Q, L) causal and within the context
    if sliding_window is not None:
        mask &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], enable_gqa=q.shape[1] != keys.shape[1]
    )  # (S, H, Q, D)
    if Q == 1:
        return out.squeeze(2)
    return _unpad_queries(out, meta.query_lens)


def _pad_queries(q: torch.Tensor, query_lens: torch.Tensor, Q: int) -> torch.Tensor:
    """(N, H, D) flat queries -> (S, H, Q, D), each sequence's queries left-aligned, zeros after."""
    S = query_lens.shape[0]
    seq_of_token = torch.repeat_interleave(torch.arange(S, device=q.device), query_lens)  # (N,)
    starts = torch.cumsum(query_lens, 0) - query_lens
    offset = torch.arange(q.shape[0], device=q.device) - starts[seq_of_token]  # (N,)
    padded = q.new_zeros(S, Q, *q.shape[1:])
    padded[seq_of_token, offset] = q
    return padded.transpose(1, 2)


def _unpad_queries(out: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """(S, H, Q, D) -> (N, H, D), dropping the padding rows."""
    S, H, Q, D = out.shape
    valid = torch.arange(Q, device=out.device)[None, :] < query_lens[:, None]  # (S, Q)
    return out.transpose(1, 2)[valid]

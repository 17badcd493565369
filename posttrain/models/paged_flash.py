"""Paged attention through flash-attn's kernels (the `flash_attn` package, FlashAttention-2), used only when
that package is installed; nothing here runs in the CPU test suite.

flash-attn reads paged K/V in our pool's own layout: a layer's cache[0] and cache[1] are
(num_blocks, block_size, Hkv, D), indexed through int32 block tables. Decode steps (one query per
sequence) call `flash_attn_with_kvcache`; steps with prefill chunks call `flash_attn_varlen_func` over
the flat queries, whose causal mask is aligned to the end of each context (query i of a sequence sees
keys up to context_len - query_len + i), which is the paged contract. flash-attn 2 takes paged K/V only
in blocks of a multiple of 256 tokens (EngineConfig.block_size).
"""

from __future__ import annotations

import importlib.util

import torch

from posttrain.models.attention_metadata import PagedAttentionMetadata

BLOCK_MULTIPLE = 256  # flash-attn 2's paged KV block size must be a multiple of this


def available() -> bool:
    """The flash_attn package is importable (found without importing it: it loads CUDA libraries)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: PagedAttentionMetadata, sliding_window: int | None
) -> torch.Tensor:
    """q (N, H, D), cache (2, num_blocks, block_size, Hkv, D) with this step's K/V written -> (N, H, D)."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    # flash-attn's window counts keys before the query, ours counts the query too (q_pos - k_pos < window).
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    tables, context_lens, cu_query, cu_context = meta.cached_plan("flash", lambda: _int32_plan(meta))
    q = q.contiguous()
    if meta.max_query_len == 1:
        out = flash_attn_with_kvcache(
            q.unsqueeze(1),
            cache[0],
            cache[1],
            cache_seqlens=context_lens,
            block_table=tables,
            causal=True,
            window_size=window,
        )  # (S, 1, H, D)
        return out.squeeze(1)
    return flash_attn_varlen_func(
        q,
        cache[0],
        cache[1],
        cu_query,
        cu_context,
        meta.max_query_len,
        tables.shape[1] * cache.shape[2],  # an upper bound of the longest context, known without a sync
        causal=True,
        window_size=window,
        block_table=tables,
    )  # (N, H, D)


def _int32_plan(meta: PagedAttentionMetadata) -> tuple[torch.Tensor, ...]:
    """Block tables (S, W), context lengths (S,) and the cumulative query / context offsets (S + 1,), int32."""
    zero = meta.context_lens.new_zeros(1)
    cu_query = torch.cat([zero, torch.cumsum(meta.query_lens, 0)]).to(torch.int32)
    cu_context = torch.cat([zero, torch.cumsum(meta.context_lens, 0)]).to(torch.int32)
    return meta.block_tables.to(torch.int32), meta.context_lens.to(torch.int32), cu_query, cu_context

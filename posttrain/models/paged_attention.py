"""Attention over a paged KV cache: write the new tokens' K/V into their slots, then attend over each
sequence's blocks. `paged_attention` picks the kernel named by the metadata's `backend`
(`PAGED_BACKENDS`; the engine sets it from EngineConfig.attention_backend, docs/engine.md "Attention
backends"):

- "reference" (`reference_paged_attention`): gathers every sequence's whole context and runs masked
  SDPA. Simple and obviously right: the oracle in tests, and the fallback on any device.
- "flex" (posttrain/models/paged_flex.py): PyTorch's FlexAttention over the pool in place, with a paged
  BlockMask; a fused Triton kernel on CUDA.
- "flash" (posttrain/models/paged_flash.py): flash-attn's paged kernels, when that package is installed.
- "cpu": the CPU fast path below. Decode rows (one new token) use cascade attention:
  sequences that share leading blocks (the n samples of a prompt after the prefill fork) attend those
  blocks ONCE as a group, with the group's query heads stacked as query rows; each sequence then attends
  its own remaining blocks, and the two parts combine exactly (online softmax / log-sum-exps).
  * With the native kernels (posttrain/kernels, C compiled on first use) every K/V byte is
    read once, straight from the pool, and the K/V writes are row copies. benchmarks/paged_attention.py
    (512 sequences in 64 groups, SmolLM2-135M shapes, 80 shared prompt tokens, 72 own): 2.8 ms a layer,
    against 14.65 ms for the PyTorch version below on a step that gathers, and 8.31 ms for SDPA over a
    dense padded cache (transformers' layout).
  * Without them, in PyTorch: each part gathers its blocks into reused buffers (a fresh 50-100 MB tensor
    per layer costs more in page faults than the copy itself; decode_staging carries the suffixes over
    from step to step), runs SDPA's flash kernel with grouped-query heads as query rows, and merges the
    two partial softmaxes with their log-sum-exps.
  Prefill rows (query_len > 1) gather their context once into a reused buffer and run masked SDPA.
  Layers with a sliding window, and tensors off the CPU, take the reference.

Which rows decode and which prefill, and how decoding sequences group, is planned once per step
(posttrain/models/paged_plan.py) and shared by every layer.

All K/V writes of a layer happen before any read, so a block computed in this step by one sequence
may be read in the same step by another (the engine's prefix cache relies on it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from posttrain import kernels
from posttrain.models.attention_metadata import PagedAttentionMetadata
from posttrain.models.paged_flash import flash_paged_attention
from posttrain.models.paged_flex import flex_paged_attention
from posttrain.models.paged_plan import DecodePlan, PrefillPlan, plan_for
from posttrain.models.paged_workspace import PagedWorkspace


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (2, num_blocks, block_size, Hkv, D); k, v (N, Hkv, D); slots < 0 are skipped."""
    flat = cache.view(2, -1, *cache.shape[-2:])  # (2, num_slots, Hkv, D)
    # Inside CUDA graph capture no host sync is allowed; the engine then passes only slots >= 0.
    capturing = slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing()
    keep = slot_mapping >= 0
    if not capturing and not bool(keep.all()):
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
    """q (N, H, D), k/v (N, Hkv, D) for the new tokens -> attention output (N, H, D), by meta.backend."""
    backend = meta.backend or ("cpu" if q.device.type == "cpu" else "reference")
    if backend == "cpu":
        return cpu_paged_attention(q, k, v, meta, layer_idx, sliding_window)
    cache = meta.kv_caches[layer_idx]
    write_kv(cache, k, v, meta.slot_mapping)
    return PAGED_BACKENDS[backend](q, cache, meta, sliding_window)


def cpu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PagedAttentionMetadata,
    layer_idx: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The CPU fast path (module docstring); the reference for windowed layers and off the CPU."""
    cache = meta.kv_caches[layer_idx]
    native = meta.native_kernels and sliding_window is None and kernels.supports(q, cache)
    if native:
        kernels.write_kv(cache, k, v, meta.slot_mapping)
    else:
        write_kv(cache, k, v, meta.slot_mapping)
    if q.device.type != "cpu" or sliding_window is not None:
        return _reference_attend(q, cache, meta, sliding_window)
    plan = plan_for(meta, cache.shape[2], native)
    out = torch.empty_like(q)  # (N, H, D)
    if plan.native_decode is not None:
        d = plan.native_decode
        kernels.decode_attention(
            q.contiguous(), cache, out, d.tables, d.context_lens, d.rows, d.group_starts, d.group_shared, d.max_members
        )
    elif plan.decode is not None:
        decoded = _decode_attend(q, k, v, cache, plan.decode, layer_idx, meta.workspace)
        out.index_copy_(0, plan.decode.token_rows, decoded)
    if plan.prefill is not None:
        out.index_copy_(0, plan.prefill.token_rows, _prefill_attend(q, cache, plan.prefill, meta.workspace))
    return out


def reference_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PagedAttentionMetadata,
    layer_idx: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The simple version: every sequence's whole context gathered, masked SDPA. Same contract."""
    cache = meta.kv_caches[layer_idx]
    write_kv(cache, k, v, meta.slot_mapping)
    return _reference_attend(q, cache, meta, sliding_window)


def _reference_attend(
    q: torch.Tensor, cache: torch.Tensor, meta: PagedAttentionMetadata, sliding_window: int | None
) -> torch.Tensor:
    S, max_blocks = meta.block_tables.shape
    block_size = cache.shape[2]
    L = max_blocks * block_size
    keys = cache[0][meta.block_tables].view(S, L, *cache.shape[-2:]).transpose(1, 2)  # (S, Hkv, L, D)
    values = cache[1][meta.block_tables].view(S, L, *cache.shape[-2:]).transpose(1, 2)
    queries = sequence_queries(q, meta)  # (S, H, Q, D)
    mask = context_mask(meta, L, sliding_window)  # (S, Q, L)
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], enable_gqa=q.shape[1] != keys.shape[1]
    )  # (S, H, Q, D)
    return flat_outputs(out, meta)


# The kernels that attend after the K/V writes: (q, cache, meta, sliding_window) -> (N, H, D). "cpu" writes
# its own K/V (row copies in C) and is called by name above.
PAGED_BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata, int | None], torch.Tensor]] = {
    "reference": _reference_attend,
    "flex": flex_paged_attention,
    "flash": flash_paged_attention,
}


def sequence_queries(q: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
    """(N, H, D) flat queries -> (S, H, Q, D), Q = max_query_len (zeros pad shorter sequences)."""
    if meta.max_query_len == 1:
        return q.unsqueeze(2)
    return pad_queries(q, meta.query_lens, meta.max_query_len)


def flat_outputs(out: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
    """(S, H, Q, D) -> (N, H, D): the inverse of `sequence_queries`."""
    if meta.max_query_len == 1:
        return out.squeeze(2)
    return unpad_queries(out, meta.query_lens)


def context_mask(meta: PagedAttentionMetadata, L: int, sliding_window: int | None = None) -> torch.Tensor:
    """(S, Q, L) bool: query i of sequence s (at position context_len - query_len + i) sees key slot j of
    its gathered blocks when j is causal, inside the context and, with a window, less than it behind."""
    device = meta.context_lens.device
    q_pos = (meta.context_lens - meta.query_lens)[:, None] + torch.arange(meta.max_query_len, device=device)[
        None
    ]  # (S, Q)
    k_pos = torch.arange(L, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, Q, L)
    if sliding_window is not None:
        mask &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    return mask


def pad_queries(q: torch.Tensor, query_lens: torch.Tensor, Q: int) -> torch.Tensor:
    """(N, H, D) flat queries -> (S, H, Q, D), each sequence's queries left-aligned, zeros after."""
    S = query_lens.shape[0]
    seq_of_token = torch.repeat_interleave(torch.arange(S, device=q.device), query_lens)  # (N,)
    starts = torch.cumsum(query_lens, 0) - query_lens
    offset = torch.arange(q.shape[0], device=q.device) - starts[seq_of_token]  # (N,)
    padded = q.new_zeros(S, Q, *q.shape[1:])
    padded[seq_of_token, offset] = q
    return padded.transpose(1, 2)


def unpad_queries(out: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """(S, H, Q, D) -> (N, H, D), dropping the padding rows."""
    S, H, Q, D = out.shape
    valid = torch.arange(Q, device=out.device)[None, :] < query_lens[:, None]  # (S, Q)
    return out.transpose(1, 2)[valid]


# ---- the CPU fast path: kernels ----------------------------------------------------------------------


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, workspace: PagedWorkspace, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cache (2, num_blocks, bs, Hkv, D), blocks (B, W) -> K, V as (B, Hkv, W * bs, D) views of a buffer."""
    _, num_blocks, bs, hkv, d = cache.shape
    B, W = blocks.shape
    flat = cache.view(2, num_blocks, bs * hkv * d)
    out = workspace.buffer(name, (2, B * W, bs * hkv * d), cache)
    index = blocks.reshape(-1)
    torch.index_select(flat[0], 0, index, out=out[0])
    torch.index_select(flat[1], 0, index, out=out[1])
    kv = out.view(2, B, W * bs, hkv, d)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (B, Hkv, L, D) each


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention with its log-sum-exp: q (B, Hkv, M, D), k/v (B, Hkv, L, D), mask additive."""
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask
    )
    return out, lse  # (B, Hkv, M, D), (B, Hkv, M)


def _decode_attend(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: torch.Tensor,
    plan: DecodePlan,
    layer_idx: int,
    workspace: PagedWorkspace,
) -> torch.Tensor:
    """-> (Sd, H, D) for the decode sequences, in plan order; k_new / v_new (N, Hkv, D) this step's K/V."""
    _, H, D = q.shape
    hkv = cache.shape[3]
    G = H // hkv  # query heads per K/V head
    Sd = plan.token_rows.shape[0]
    queries = q.index_select(0, plan.token_rows).view(Sd, hkv, G, D)  # (Sd, Hkv, G, D): heads as query rows
    staged = None
    if plan.staging is not None:
        staged = workspace.staging.append(
            layer_idx, plan.staging, k_new.index_select(0, plan.token_rows), v_new.index_select(0, plan.token_rows)
        )
    if staged is not None:
        k, v = staged
    else:
        k, v = _gather(cache, plan.suffix_blocks, workspace, "suffix")
        if plan.staging is not None:
            workspace.staging.store(layer_idx, plan.staging, k, v)
    out, lse = _flash(queries, k, v, plan.suffix_mask)  # (Sd, Hkv, G, D), (Sd, Hkv, G)
    if plan.group_blocks is not None:
        M = plan.members_per_group
        Gp = plan.group_blocks.shape[0]
        members = q.index_select(0, plan.group_query_rows).view(Gp, M, hkv, G, D)
        members = members.transpose(1, 2).reshape(Gp, hkv, M * G, D)  # (Gp, Hkv, M*G, D)
        pk, pv = _gather(cache, plan.group_blocks, workspace, "prefix")
        p_out, p_lse = _flash(members, pk, pv, plan.group_mask)  # (Gp, Hkv, M*G, D), (Gp, Hkv, M*G)
        p_out = p_out.view(Gp, hkv, M, G, D).transpose(1, 2).reshape(Gp * M, hkv, G, D)
        p_lse = p_lse.view(Gp, hkv, M, G).transpose(1, 2).reshape(Gp * M, hkv, G)
        p_out, p_lse = p_out.index_select(0, plan.member_slot), p_lse.index_select(0, plan.member_slot)  # (Sc, ...)
        s_out, s_lse = out.index_select(0, plan.grouped), lse.index_select(0, plan.grouped)
        # Merge the two partial softmaxes: weights exp(lse_i - lse_total).
        total = torch.logaddexp(p_lse, s_lse)  # (Sc, Hkv, G)
        merged = p_out * torch.exp(p_lse - total).unsqueeze(-1) + s_out * torch.exp(s_lse - total).unsqueeze(-1)
        out = out.index_copy(0, plan.grouped, merged.to(out.dtype))
    return out.reshape(Sd, H, D)


def _prefill_attend(q: torch.Tensor, cache: torch.Tensor, plan: PrefillPlan, workspace: PagedWorkspace) -> torch.Tensor:
    """-> (Np, H, D) for the prefill sequences' tokens, in plan order."""
    _, H, D = q.shape
    hkv = cache.shape[3]
    k, v = _gather(cache, plan.blocks, workspace, "prefill")  # (Sp, Hkv, L, D)
    flat = q.index_select(0, plan.token_rows)  # (Np, H, D)
    queries = pad_queries(flat, plan.query_lens, plan.max_query_len)  # (Sp, H, Q, D)
    out = F.scaled_dot_product_attention(
        queries, k.to(q.dtype), v.to(q.dtype), attn_mask=plan.mask, enable_gqa=H != hkv
    )  # (Sp, H, Q, D)
    return unpad_queries(out, plan.query_lens)

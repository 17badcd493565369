"""One Attention module with two paths chosen by the metadata it is given.

- Dense path (training, scoring): tokens as (B, T); `DenseAttentionMetadata` carries the mask that
  encodes causality, padding and packed segments; it builds each sliding window's mask on demand.
- Paged path (the rollout engine): tokens flattened to (N,) across sequences; `PagedAttentionMetadata`
  carries the per-layer KV cache blocks and where each new token's K/V goes. The engine fills it in;
  the kernel lives in `paged_attention.py`.

The model knows nothing of the engine: these dataclasses are the whole contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.config import ModelConfig
from posttrain.models.layers import RMSNorm, apply_rotary


@dataclass
class DenseAttentionMetadata:
    """mask (B, 1, T, T) bool, True where query t may attend key s; None means plain causal.

    positions (B, T): the tokens' positions; layers with a sliding window keep keys whose position is
    less than `window` before the query's (positions, not indices, so packed rows whose completions
    share a prompt slide correctly). The windowed masks are built once per forward, on first use.
    """

    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def mask_for_window(self, window: int | None, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """The mask for a layer with this sliding window (None: full attention, the plain mask)."""
        if window is None:
            return self.mask
        if window not in self._windowed:
            idx = torch.arange(seq_len, device=device)
            base = self.mask if self.mask is not None else (idx[None, :] <= idx[:, None])[None, None]  # (B|1, 1, T, T)
            pos = self.positions if self.positions is not None else idx[None]  # (B|1, T)
            near = (pos[:, None, :, None] - pos[:, None, None, :]) < window  # (B|1, 1, T, T)
            eye = torch.eye(seq_len, dtype=torch.bool, device=device)[None, None]
            self._windowed[window] = (base & near) | eye
        return self._windowed[window]


@dataclass
class PagedAttentionMetadata:
    """What one engine step needs; S sequences, N new tokens in all, in sequence order.

    kv_caches[layer]: (2, num_blocks, block_size, n_kv_heads, head_dim), K at [0] and V at [1].
    slot_mapping (N,): flat slot (block_id * block_size + offset) where each new token's K/V is written;
        a negative slot means "do not write" (its K/V is already cached).
    block_tables (S, max_blocks): the cache blocks of each sequence, in order (padded with 0).
    context_lens (S,): tokens each sequence can see after this step's writes (cached + new).
    query_lens (S,): new tokens per sequence this step; they are the last query_lens of its context.
    max_query_len: max(query_lens); 1 means a pure decode step.
    """

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    max_query_len: int


AttentionMetadata = DenseAttentionMetadata | PagedAttentionMetadata


def build_dense_mask(
    seq_len: int,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """The (B|1, 1, T, T) bool mask for causal attention with padding / packing / a sliding window.

    attention_mask (B, T): 1 for real tokens, 0 for padding (left or right).
    segment_ids (B, T): packed sequences; a token attends only within its own segment.
    Returns None when plain causal attention suffices (lets SDPA use its causal fast path).
    """
    if attention_mask is None and segment_ids is None and sliding_window is None:
        return None
    idx = torch.arange(seq_len, device=device)
    mask = (idx[None, :] <= idx[:, None])[None, None]  # (1, 1, T, T) causal
    if sliding_window is not None:
        mask = mask & (idx[:, None] - idx[None, :] < sliding_window)[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])  # (B, 1, T, T)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    # A padded query would see no key at all (NaN from softmax): let it see itself. Its output is never used.
    return mask | torch.eye(seq_len, dtype=torch.bool, device=device)[None, None]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) positions counting real tokens only, so left padding does not shift RoPE."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def positions_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids of packed rows -> positions that restart at 0 in each segment."""
    B, T = segment_ids.shape
    idx = torch.arange(T, device=segment_ids.device).expand(B, T)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values  # index where each segment began
    return idx - start_idx


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads (MHA, MQA and GQA from num_key_value_heads)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sliding_window = cfg.attention_window(layer_idx)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias, device=device)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias, device=device)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias, device=device)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False, device=device)
        # Qwen3 normalises each head of q and k before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, device) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x (B, T, d) on the dense path or (N, d) on the paged path; cos/sin match x's leading dims."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)  # (..., H, D)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)  # (..., Hkv, D)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if isinstance(meta, PagedAttentionMetadata):
            from posttrain.models.paged_attention import paged_attention

            out = paged_attention(q, k, v, meta, self.layer_idx, self.sliding_window)  # (N, H, D)
        else:
            out = self._dense(q, k, v, meta)  # (B, T, H, D)
        return self.o_proj(out.reshape(*lead, self.n_heads * self.head_dim))

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DenseAttentionMetadata) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        return dense_attention(q, k, v, meta.mask_for_window(self.sliding_window, q.shape[2], q.device)).transpose(1, 2)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """SDPA over (B, H, T, D) q and (B, Hkv, T, D) k/v (v may have its own last size); mask None = causal."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)

"""One Attention module with two paths chosen by the metadata it is given.

- Dense path (training, scoring): tokens as (B, T); `DenseAttentionMetadata` carries the mask that
  encodes causality, padding and packed segments; it builds each sliding window's mask on demand.
- Paged path (the rollout engine): tokens flattened to (N,) across sequences; `PagedAttentionMetadata`
  carries the per-layer KV cache blocks and where each new token's K/V goes. The engine fills it in;
  the kernel lives in `paged_attention.py`.

The model knows nothing of the engine: these dataclasses (attention_metadata.py) are the whole contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.attention_metadata import AttentionMetadata, DenseAttentionMetadata, PagedAttentionMetadata
from posttrain.models.config import ModelConfig
from posttrain.models.layers import RMSNorm, apply_rotary
from posttrain.models.paged_attention import paged_attention


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x (B, T, d) on the dense path or (N, d) on the paged path; cos/sin match x's leading dims."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)  # (..., H, D)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)  # (..., Hkv, D)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if isinstance(meta, PagedAttentionMetadata):
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

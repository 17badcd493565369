"""Multi-head latent attention (DeepSeek-V2/V3), dense and paged.

Per token the keys and values of all H heads come from one compressed latent c (kv_lora_rank values,
RMS-normed) through kv_b_proj, plus one rotary key k_rot (qk_rope_head_dim) shared by every head:

    k_h = [W_uk,h c ; k_rot]    v_h = W_uv,h c    q_h = [q_nope,h ; q_rot,h]

- Dense path (training): expand c into per-head K and V and run SDPA, as transformers does.
- Paged path (the engine): cache only [c ; k_rot] per token (kv_lora_rank + qk_rope_head_dim values,
  one "KV head") and absorb W_uk into the query and W_uv into the output:
      q_h . k_h = (W_uk,h^T q_nope,h) . c + q_rot,h . k_rot      out_h = W_uv,h (sum_j p_j c_j)
  so attention is MQA over the latent: keys [c ; k_rot], values c. Same result, and the cache holds
  (kv_lora_rank + qk_rope_head_dim) values per token and layer instead of H * (qk_head_dim + v_head_dim).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.attention import (
    AttentionMetadata,
    DenseAttentionMetadata,
    PagedAttentionMetadata,
    dense_attention,
)
from posttrain.models.config import ModelConfig
from posttrain.models.layers import RMSNorm, apply_rotary, apply_rotary_interleaved
from posttrain.models.paged_attention import context_mask, flat_outputs, sequence_queries


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when the config sets it."""
    scale = cfg.mla.qk_head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim") and scaling["factor"] > 1:
        mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """DeepSeek MLA; parameter names as in the HF checkpoints (q_a_proj, kv_a_proj_with_mqa, kv_b_proj, ...)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        mla = cfg.mla
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.rank, self.nope, self.rope = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.v_dim = mla.v_head_dim
        self.qk_dim = mla.qk_head_dim
        self.scale = mla_softmax_scale(cfg)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        d, h, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.low_rank_q = mla.q_lora_rank is not None
        if not self.low_rank_q:
            self.q_proj = nn.Linear(d, h * self.qk_dim, bias=False, device=device)
        else:
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=bias, device=device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, device)  # transformers uses the default eps here
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * self.qk_dim, bias=False, device=device)
        self.kv_a_proj_with_mqa = nn.Linear(d, mla.latent_dim, bias=bias, device=device)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, device)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False, device=device)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x (B, T, d) dense or (N, d) paged -> same leading shape, d."""
        lead = x.shape[:-1]
        if self.low_rank_q:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(*lead, self.n_heads, self.qk_dim)  # (..., H, nope + rope)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)  # (..., rank), (..., rope)
        latent = self.kv_a_layernorm(latent)
        q_rot = self.rotate(q_rot, cos, sin)  # (..., H, rope)
        k_rot = self.rotate(k_rot.unsqueeze(-2), cos, sin)  # (..., 1, rope)
        if isinstance(meta, PagedAttentionMetadata):
            out = self._paged(q_nope, q_rot, latent, k_rot.squeeze(-2), meta)  # (N, H, v)
        else:
            out = self._dense(q_nope, q_rot, latent, k_rot, meta)  # (B, T, H, v)
        return self.o_proj(out.reshape(*lead, self.n_heads * self.v_dim))

    def _dense(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        meta: DenseAttentionMetadata,
    ) -> torch.Tensor:
        B, T = latent.shape[:2]
        kv = self.kv_b_proj(latent).view(B, T, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, T, H, nope), (B, T, H, v)
        q = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)  # (B, H, T, qk)
        k = torch.cat((k_nope, k_rot.expand(B, T, self.n_heads, self.rope)), dim=-1).transpose(1, 2)  # (B, H, T, qk)
        return dense_attention(q, k, v.transpose(1, 2), meta.mask, scale=self.scale).transpose(1, 2)  # (B, T, H, v)

    def _paged(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        cache = meta.kv_caches[self.layer_idx]  # (1, num_blocks, block_size, 1, rank + rope)
        write_latent(cache, torch.cat((latent, k_rot), dim=-1), meta.slot_mapping)
        w_uk, w_uv = self._absorbed_weights(q_nope.dtype, q_nope.device)  # (H, nope, rank), (H, v, rank)
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # (N, H, rank)
        queries = sequence_queries(torch.cat((q_latent, q_rot), dim=-1), meta)  # (S, H, Q, rank + rope)
        S, max_blocks = meta.block_tables.shape
        L = max_blocks * cache.shape[2]
        keys = cache[0][meta.block_tables].view(S, 1, L, cache.shape[-1]).to(q_nope.dtype)  # (S, 1, L, rank + rope)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            keys[..., : self.rank],
            attn_mask=context_mask(meta, L)[:, None],
            scale=self.scale,
            enable_gqa=True,
        )  # (S, H, Q, rank)
        return torch.einsum("nhr,hvr->nhv", flat_outputs(out, meta), w_uv)  # (N, H, v)

    def _absorbed_weights(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's map as (H, nope, rank) for keys and (H, v, rank) for values. A wrapped kv_b_proj
        (LoRA, quantized) has no plain weight: its map is read off by applying it to the identity."""
        if isinstance(self.kv_b_proj, nn.Linear):
            weight = self.kv_b_proj.weight  # (H * (nope + v), rank)
        else:
            eye = torch.eye(self.rank, device=device, dtype=dtype)
            weight = self.kv_b_proj(eye).T  # (H * (nope + v), rank)
        weight = weight.to(dtype).view(self.n_heads, self.nope + self.v_dim, self.rank)
        return weight[:, : self.nope], weight[:, self.nope :]


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (1, num_blocks, block_size, 1, D); latent (N, D); slots < 0 are skipped."""
    flat = cache.view(-1, cache.shape[-1])  # (num_slots, D)
    capturing = slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing()
    keep = slot_mapping >= 0
    if not capturing and not bool(keep.all()):
        latent, slot_mapping = latent[keep], slot_mapping[keep]
    flat.index_copy_(0, slot_mapping, latent.to(cache.dtype))

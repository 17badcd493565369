"""The decoder: one definition for training, scoring and the rollout engine."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.kernels import fused
from posttrain.models.attention import (
    Attention,
    AttentionMetadata,
    DenseAttentionMetadata,
    PagedAttentionMetadata,
    build_dense_mask,
    positions_from_mask,
    positions_from_segments,
)
from posttrain.models.config import ModelConfig
from posttrain.models.layers import RMSNorm, RotaryEmbedding, SwiGLU
from posttrain.models.mla import LatentAttention
from posttrain.models.moe import FFN_NAMES, MoEBlock


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)).

    The attention is grouped-query or, with cfg.mla, latent; the feed-forward is a SwiGLU MLP or, in the
    layers cfg.moe makes sparse, a mixture of experts. The FFN sits under the checkpoints' attribute name
    (`mlp`, Mixtral's `block_sparse_moe`), held in `ffn_name`.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = (LatentAttention if cfg.mla is not None else Attention)(cfg, layer_idx, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        if cfg.moe is not None and cfg.moe.is_sparse(layer_idx):
            self.ffn_name = FFN_NAMES.get(cfg.model_type, "mlp")
            self.add_module(self.ffn_name, MoEBlock(cfg.model_type, cfg.hidden_size, cfg.moe, device))
        else:
            self.ffn_name = "mlp"
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, meta)
        norm = self.post_attention_layernorm
        if fused.active(x):  # the engine's CPU forward: the residual add and the norm in one pass
            x, normed = fused.add_rms_norm(x, attended, norm.weight, norm.eps)
        else:
            x = x + attended
            normed = norm(x)
        return x + getattr(self, self.ffn_name)(normed)


class Transformer(nn.Module):
    """Llama-family decoder. `model(ids)` returns logits; `hidden_states` + `logits` split the two halves
    so callers (losses, the engine) can project only the positions they need.

    `device="meta"` builds the structure without allocating or initialising weights (the loader then
    assigns real tensors); otherwise weights get a small random init (for tests and from-scratch runs).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        # Embedding init is done by hand: nn.Embedding's normal_ on "meta" pulls in torch._dynamo (seconds).
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size, device=device)
        if embedding.device.type != "meta":
            nn.init.normal_(embedding)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        attn_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V). See `hidden_states` for the arguments."""
        return self.logits(self.hidden_states(input_ids, attention_mask, positions, segment_ids, attn_meta))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        attn_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states, (B, T, d) dense or (N, d) paged.

        Dense: input_ids (B, T); attention_mask (B, T) 1/0 for left or right padding; segment_ids (B, T) for
        packed rows (attention stays inside a segment, positions restart). Positions default to those implied
        by the mask / segments. Paged: input_ids and positions (N,) with a PagedAttentionMetadata from the engine.
        """
        if isinstance(attn_meta, PagedAttentionMetadata):
            if positions is None:
                raise ValueError("the paged path needs explicit positions (N,)")
        else:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
            if positions is None:
                positions = self._default_positions(input_ids, attention_mask, segment_ids)
            if attn_meta is None:
                mask = build_dense_mask(input_ids.shape[1], attention_mask, segment_ids, device=input_ids.device)
                attn_meta = DenseAttentionMetadata(mask, positions)
            elif attn_meta.positions is None:  # sliding windows are measured in positions
                attn_meta = DenseAttentionMetadata(attn_meta.mask, positions)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., V); cast to fp32 so log-softmax is stable under bf16 compute."""
        return self.lm_head(hidden).float()

    @staticmethod
    def _default_positions(
        input_ids: torch.Tensor, attention_mask: torch.Tensor | None, segment_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if segment_ids is not None:
            return positions_from_segments(segment_ids)
        if attention_mask is not None:
            return positions_from_mask(attention_mask)
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of one layer's paged KV cache: (2, num_blocks, block_size, Hkv, head_dim) with K at [0]
        and V at [1]; with latent attention (1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim)."""
        cfg = self.config
        if cfg.mla is not None:
            return (1, num_blocks, block_size, 1, cfg.mla.latent_dim)
        return (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

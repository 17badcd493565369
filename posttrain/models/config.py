"""ModelConfig: the architecture of one decoder, parsed from an HF `config.json` dict.

One dataclass covers the families as transformers configures them: Llama 2/3, SmolLM2, Qwen2/2.5
(q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim), Mistral (sliding window), and the sparse ones:
Mixtral, Qwen2-MoE, Qwen3-MoE (mixture-of-experts MLPs, `MoEConfig`) and DeepSeek-V2/V3 (multi-head
latent attention, `MLAConfig`, plus their MoE). The differences are fields, not subclasses; the
family-specific key names of config.json are read in `models/family_config.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.errors import CheckpointError
from posttrain.models.family_config import (
    FAMILY_DEFAULTS,
    MLA_KEYS,
    MOE_KEYS,
    SLIDING_KEYS,
    MLAConfig,
    MoEConfig,
    layer_types_from_hf,
    mla_from_hf,
    mla_to_hf,
    moe_from_hf,
    moe_to_hf,
    sliding_window_to_hf,
)

# model_type -> the transformers class name written into a saved config.json.
ARCHITECTURE_NAMES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

SLIDING = "sliding_attention"


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int  # per-head size of q/k/v; with MLA the rotary part of q/k (qk_rope_head_dim), as HF sets it
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer "full_attention" / "sliding_attention" when only some layers slide (Qwen2/3 with
    # max_window_layers); None with a sliding_window means every layer slides (Mistral, Mixtral).
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (in the layers moe.is_sparse names)
    mla: MLAConfig | None = None  # multi-head latent attention instead of grouped-query attention
    # Keys of config.json we do not interpret, kept so a saved config round-trips.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse an HF config dict; `source` names the file in error messages."""
        model_type = hf.get("model_type")
        if model_type not in FAMILY_DEFAULTS:
            supported = ", ".join(sorted(FAMILY_DEFAULTS))
            raise CheckpointError(
                f"{source}: unsupported architecture model_type={model_type!r} (supported: {supported})"
            )
        for key in REQUIRED_KEYS:
            if key not in hf:
                raise CheckpointError(f"{source}: missing required key {key!r}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: unsupported hidden_act={act!r} (SwiGLU with silu only)")
        if hf.get("mlp_bias"):
            raise CheckpointError(f"{source}: mlp_bias=true is not supported")
        family = FAMILY_DEFAULTS[model_type]
        n_heads = int(hf["num_attention_heads"])
        mla = mla_from_hf(model_type, hf, source)
        # MLA rotates only the qk_rope_head_dim slice of each head; HF calls that head_dim too.
        head_dim = mla.qk_rope_head_dim if mla else hf.get("head_dim") or int(hf["hidden_size"]) // n_heads
        rope_scaling = _rope_scaling(hf, source)
        moe = moe_from_hf(model_type, hf, source)
        known = (
            set(cls.__dataclass_fields__)
            | {
                "architectures",
                "torch_dtype",
                "dtype",
                "rope_parameters",
                "use_cache",
                "transformers_version",
                family["bias_key"],
            }
            | SLIDING_KEYS
        )
        known |= (MOE_KEYS if moe else set()) | (MLA_KEYS if mla else set())
        cfg = cls(
            model_type=model_type,
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or n_heads),
            vocab_size=int(hf["vocab_size"]),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(hf)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get(family["bias_key"], family["attention_bias"])),
            qk_norm=family["qk_norm"],
            hidden_act=act,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            moe=moe,
            mla=mla,
            extra={k: v for k, v in hf.items() if k not in known},
        )
        if mla is None and cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        cfg.sliding_window, cfg.layer_types = layer_types_from_hf(model_type, hf, cfg.num_hidden_layers, source)
        return cfg

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """The config.json dict that transformers loads as the same architecture."""
        out = dict(self.extra)
        skip = ("extra", "qk_norm", "moe", "mla", "sliding_window", "layer_types", "attention_bias")
        out.update({k: v for k, v in asdict(self).items() if k not in skip})
        out[FAMILY_DEFAULTS[self.model_type]["bias_key"]] = self.attention_bias
        out.update(sliding_window_to_hf(self.model_type, self.sliding_window, self.layer_types, self.num_hidden_layers))
        if self.moe is not None:
            out.update(moe_to_hf(self.model_type, self.moe))
        if self.mla is not None:
            out.update(mla_to_hf(self.mla))
            out.pop("head_dim")  # derived from qk_rope_head_dim by transformers
        out["architectures"] = [ARCHITECTURE_NAMES[self.model_type]]
        out["torch_dtype"] = dtype
        if self.rope_scaling is None:
            out.pop("rope_scaling")
        return out

    def attention_window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer's attention, None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer_idx] != SLIDING:
            return None
        return self.sliding_window

    @property
    def num_parameters(self) -> int:
        """Parameter count computed from the shapes (tied embeddings counted once)."""
        d, f = self.hidden_size, self.intermediate_size
        if self.mla is not None:
            attn = self.mla.num_parameters(d, self.num_attention_heads, self.attention_bias)
        else:
            attn = self._gqa_parameters()
        dense_mlp = 3 * d * f
        total = 0
        for i in range(self.num_hidden_layers):
            sparse = self.moe is not None and self.moe.is_sparse(i)
            total += attn + 2 * d + (self.moe.num_parameters(d) if sparse else dense_mlp)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return total + embed + d

    def _gqa_parameters(self) -> int:
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        return attn

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """Bytes the engine's KV cache holds per token, all layers: K and V of every KV head, or with
        MLA the compressed latent and the shared rotary key (kv_lora_rank + qk_rope_head_dim)."""
        return self.num_hidden_layers * self.kv_elements_per_layer() * bytes_per_element

    def kv_elements_per_layer(self) -> int:
        """Cached elements per token in one layer."""
        if self.mla is not None:
            return self.mla.latent_dim
        return 2 * self.num_key_value_heads * self.head_dim


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers >= 5 nests rope settings under `rope_parameters`; older configs keep them flat.
    params = hf.get("rope_parameters") or {}
    return hf.get("rope_theta", params.get("rope_theta", 10000.0))


def _rope_scaling(hf: dict[str, Any], source: str) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling")
    if scaling is None and isinstance(hf.get("rope_parameters"), dict):
        scaling = {k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"}
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"{source}: unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}

"""ModelConfig: the architecture of one decoder, parsed from an HF `config.json` dict.

One dataclass covers the Llama family as transformers configures it: Llama 2/3, SmolLM2,
Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim), Mistral. The differences are
fields, not subclasses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.errors import CheckpointError

# model_type -> per-family defaults that config.json may leave out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False, "qk_norm": False},
    "mistral": {"attention_bias": False, "qk_norm": False},
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
}

# model_type -> the transformers class name written into a saved config.json.
ARCHITECTURE_NAMES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Keys of config.json we do not interpret, kept so a saved config round-trips.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse an HF config dict; `source` names the file in error messages."""
        model_type = hf.get("model_type")
        if model_type not in FAMILY_DEFAULTS:
            supported = ", ".join(sorted(FAMILY_DEFAULTS))
            raise CheckpointError(f"{source}: unsupported architecture model_type={model_type!r} (supported: {supported})")
        for key in REQUIRED_KEYS:
            if key not in hf:
                raise CheckpointError(f"{source}: missing required key {key!r}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: unsupported hidden_act={act!r} (SwiGLU with silu only)")
        family = FAMILY_DEFAULTS[model_type]
        n_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // n_heads
        rope_scaling = _rope_scaling(hf, source)
        known = set(cls.__dataclass_fields__) | {"architectures", "torch_dtype", "dtype", "rope_parameters", "use_cache",
                                                   "transformers_version"}
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
            attention_bias=bool(hf.get("attention_bias", family["attention_bias"])),
            qk_norm=family["qk_norm"],
            hidden_act=act,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            extra={k: v for k, v in hf.items() if k not in known and k != "sliding_window"},
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        if hf.get("sliding_window") and hf.get("use_sliding_window", model_type == "mistral"):
            if model_type != "mistral":
                # Qwen2/3 slide only in the layers from max_window_layers on: not modelled yet.
                raise CheckpointError(f"{source}: use_sliding_window=true is supported for mistral only")
            cfg.sliding_window = int(hf["sliding_window"])
        return cfg

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """The config.json dict that transformers loads as the same architecture."""
        out = dict(self.extra)
        out.update({k: v for k, v in asdict(self).items() if k not in ("extra", "qk_norm")})
        if self.model_type != "mistral":
            out.pop("sliding_window")
        out["architectures"] = [ARCHITECTURE_NAMES[self.model_type]]
        out["torch_dtype"] = dtype
        if self.rope_scaling is None:
            out.pop("rope_scaling")
        return out

    @property
    def num_parameters(self) -> int:
        """Parameter count computed from the shapes (tied embeddings counted once)."""
        d, f, h, kv, hd = self.hidden_size, self.intermediate_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + d

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """Bytes the KV cache holds per token: K and V for every layer."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element


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
        raise CheckpointError(f"{source}: unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}

"""Family-specific parts of config.json: where each family keeps its sliding window, its mixture of
experts and its latent attention, read into family-neutral fields (and written back).

The same idea goes under different keys per family (Mixtral's `num_local_experts` is Qwen's
`num_experts` and DeepSeek's `n_routed_experts`), so each reader is a short function per family group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import CheckpointError

# model_type -> defaults that config.json may leave out, and the key that holds the q/k/v bias flag.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False, "qk_norm": False, "bias_key": "attention_bias"},
    "mistral": {"attention_bias": False, "qk_norm": False, "bias_key": "attention_bias"},
    "qwen2": {"attention_bias": True, "qk_norm": False, "bias_key": "attention_bias"},
    "qwen3": {"attention_bias": False, "qk_norm": True, "bias_key": "attention_bias"},
    "mixtral": {"attention_bias": False, "qk_norm": False, "bias_key": "attention_bias"},
    "qwen2_moe": {"attention_bias": True, "qk_norm": False, "bias_key": "qkv_bias"},
    "qwen3_moe": {"attention_bias": False, "qk_norm": True, "bias_key": "attention_bias"},
    # MLA: attention_bias puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj.
    "deepseek_v2": {"attention_bias": False, "qk_norm": False, "bias_key": "attention_bias"},
    "deepseek_v3": {"attention_bias": False, "qk_norm": False, "bias_key": "attention_bias"},
}

SLIDING, FULL = "sliding_attention", "full_attention"
QWEN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")

# The config.json keys the readers below interpret (under any family's spelling): left out of
# ModelConfig.extra when parsed, so a saved config.json holds them once, as the writers spell them.
MOE_KEYS = frozenset(
    {
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
        "router_aux_loss_coef",
        "decoder_sparse_step",
        "mlp_only_layers",
        "topk_method",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "n_shared_experts",
        "first_k_dense_replace",
    }
)
MLA_KEYS = frozenset(
    {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "head_dim"}
)
SLIDING_KEYS = frozenset({"use_sliding_window"})

# Router variants (see moe.ROUTERS): how scores are made and how the top-k experts are chosen.
ROUTER_KINDS = ("softmax", "softmax_group_limited", "sigmoid_group_limited")


@dataclass
class MoEConfig:
    """A sparse MLP: a router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    router: str = "softmax"  # one of ROUTER_KINDS
    n_group: int = 1  # group-limited routing: experts in n_group groups, tokens use topk_group of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek)
    score_correction_bias: bool = False  # DeepSeek-V3: a per-expert bias used only to choose experts
    shared_expert_intermediate_size: int = 0  # 0: no shared expert; else an always-on SwiGLU of this size
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert is scaled by sigmoid(linear(x))
    router_aux_loss_coef: float = 0.0  # weight of the Switch load-balancing loss in training
    first_dense_layers: int = 0  # DeepSeek first_k_dense_replace: these leading layers keep a dense MLP
    sparse_step: int = 1  # Qwen decoder_sparse_step: layer i is sparse when (i + 1) % sparse_step == 0
    dense_layers: list[int] = field(default_factory=list)  # Qwen mlp_only_layers

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            layer_idx >= self.first_dense_layers
            and layer_idx not in self.dense_layers
            and (layer_idx + 1) % self.sparse_step == 0
        )

    def num_parameters(self, hidden_size: int) -> int:
        """Parameters of one sparse MLP (router, experts, shared expert and its gate)."""
        d = hidden_size
        n = self.num_experts * d + self.num_experts * 3 * d * self.moe_intermediate_size
        n += 3 * d * self.shared_expert_intermediate_size
        return n + (d if self.shared_expert_gate else 0)


@dataclass
class MLAConfig:
    """DeepSeek multi-head latent attention: K and V come from a per-token latent of kv_lora_rank
    values (shared by all heads) plus one rotary key of qk_rope_head_dim; only those are cached."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: queries from one q_proj; else q_a_proj -> norm -> q_b_proj
    qk_nope_head_dim: int  # the per-head part of q/k without position
    qk_rope_head_dim: int  # the rotary part, shared by all heads on the key side
    v_head_dim: int
    rope_interleave: bool = True  # rotary dims as interleaved pairs (DeepSeek) rather than halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the compressed latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def num_parameters(self, hidden_size: int, num_heads: int, bias: bool) -> int:
        d, h = hidden_size, num_heads
        if self.q_lora_rank is None:
            n = d * h * self.qk_head_dim
        else:
            n = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
            n += self.q_lora_rank if bias else 0
        n += d * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        n += h * self.v_head_dim * d
        return n + (self.latent_dim + d if bias else 0)


# ---- sliding window -----------------------------------------------------------------------------------


def layer_types_from_hf(
    model_type: str, hf: dict[str, Any], num_layers: int, source: str
) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types): None, None when no layer slides; layer_types None when all do."""
    window = hf.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        return (int(window), None) if window else (None, None)
    if model_type not in QWEN_FAMILIES or not (window and hf.get("use_sliding_window")):
        return None, None
    types = hf.get("layer_types")
    if model_type == "qwen3_moe":  # slides in every layer; transformers ignores layer_types here
        types = [SLIDING] * num_layers
    elif types is None:  # configs from before transformers wrote layer_types: the family's own rule
        first = int(hf.get("max_window_layers", 28))
        if model_type == "qwen2_moe":
            types = [SLIDING if (i + 1) % 2 and i < first else FULL for i in range(num_layers)]
        else:
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointError(f"{source}: layer_types must list {num_layers} of {FULL!r} / {SLIDING!r}")
    if SLIDING not in types:
        return None, None
    return int(window), (None if all(t == SLIDING for t in types) else list(types))


def sliding_window_to_hf(
    model_type: str, window: int | None, layer_types: list[str] | None, num_layers: int
) -> dict[str, Any]:
    if model_type in ("mistral", "mixtral"):
        return {"sliding_window": window}
    if model_type not in QWEN_FAMILIES:
        return {}
    if window is None:
        return {"use_sliding_window": False}
    out: dict[str, Any] = {"use_sliding_window": True, "sliding_window": window}
    if model_type != "qwen3_moe":  # Qwen3-MoE slides in every layer and has no layer_types
        out["layer_types"] = list(layer_types or [SLIDING] * num_layers)
    return out


# ---- mixture of experts --------------------------------------------------------------------------------


def moe_from_hf(model_type: str, hf: dict[str, Any], source: str) -> MoEConfig | None:
    try:
        if model_type == "mixtral":
            # Mixtral's experts use intermediate_size, every layer is sparse, weights always renormalised.
            return MoEConfig(
                num_experts=int(_first(hf, "num_local_experts", "num_experts") or 8),
                num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
                moe_intermediate_size=int(hf["intermediate_size"]),
                norm_topk_prob=True,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            )
        if model_type in ("qwen2_moe", "qwen3_moe"):
            if not _first(hf, "num_experts", "num_local_experts"):
                return None
            shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
            return MoEConfig(
                num_experts=int(_first(hf, "num_experts", "num_local_experts")),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=shared,
                shared_expert_gate=shared > 0,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                sparse_step=int(hf.get("decoder_sparse_step", 1)),
                dense_layers=list(hf.get("mlp_only_layers") or []),
            )
        if model_type in DEEPSEEK_FAMILIES:
            return _deepseek_moe(model_type, hf, source)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: bad mixture-of-experts settings for {model_type} ({exc!r})") from None
    return None


def _first(hf: dict[str, Any], *keys: str) -> Any:
    """The value under the first of `keys` that is set (transformers accepts several spellings)."""
    return next((hf[k] for k in keys if hf.get(k) is not None), None)


def _deepseek_moe(model_type: str, hf: dict[str, Any], source: str) -> MoEConfig:
    if model_type == "deepseek_v3":
        router, norm = "sigmoid_group_limited", bool(hf.get("norm_topk_prob", True))
    else:
        method = hf.get("topk_method", "greedy")
        routers = {"greedy": "softmax", "group_limited_greedy": "softmax_group_limited"}
        if method not in routers:
            raise CheckpointError(f"{source}: unsupported topk_method={method!r} (greedy, group_limited_greedy)")
        # transformers' DeepSeek-V2 router never renormalises (released V2 configs set norm_topk_prob=false).
        router, norm = routers[method], False
    n_experts = int(_first(hf, "n_routed_experts", "num_experts", "num_local_experts"))
    shared = int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"])
    return MoEConfig(
        num_experts=n_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=norm,
        router=router,
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        score_correction_bias=model_type == "deepseek_v3",
        shared_expert_intermediate_size=shared,
        first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
    )


def moe_to_hf(model_type: str, moe: MoEConfig) -> dict[str, Any]:
    if model_type == "mixtral":
        return {
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "router_aux_loss_coef": moe.router_aux_loss_coef,
        }
    if model_type in ("qwen2_moe", "qwen3_moe"):
        experts_key = "num_experts" if model_type == "qwen2_moe" else "num_local_experts"  # each class's own spelling
        out = {
            experts_key: moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob,
            "router_aux_loss_coef": moe.router_aux_loss_coef,
            "decoder_sparse_step": moe.sparse_step,
            "mlp_only_layers": list(moe.dense_layers),
        }
        if model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
        return out
    out = {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_shared_experts": moe.shared_expert_intermediate_size // max(moe.moe_intermediate_size, 1),
        "first_k_dense_replace": moe.first_dense_layers,
    }
    if model_type == "deepseek_v2":
        out["topk_method"] = "greedy" if moe.router == "softmax" else "group_limited_greedy"
    return out


# ---- multi-head latent attention ---------------------------------------------------------------------


def mla_from_hf(model_type: str, hf: dict[str, Any], source: str) -> MLAConfig | None:
    if model_type not in DEEPSEEK_FAMILIES:
        return None
    try:
        q_rank = hf.get("q_lora_rank")
        return MLAConfig(
            kv_lora_rank=int(hf["kv_lora_rank"]),
            q_lora_rank=int(q_rank) if q_rank else None,
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            # DeepSeek-V2 always rotates interleaved pairs; V3 says so in rope_interleave.
            rope_interleave=bool(hf.get("rope_interleave", True)) if model_type == "deepseek_v3" else True,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: bad latent-attention settings for {model_type} ({exc!r})") from None


def mla_to_hf(mla: MLAConfig) -> dict[str, Any]:
    return {
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave,
    }

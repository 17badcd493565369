"""Tiny random HF checkpoints of the families beyond dense Llama: sliding windows per layer, mixtures
of experts and latent attention, made by transformers (the oracle). Shapes follow tests/hf_oracle.py."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_oracle import TINY_COMMON

MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)

# family -> (transformers config class name, extra config keys)
SPARSE_FAMILIES: dict[str, tuple[str, dict]] = {
    # Layer 0 full attention, layer 1 a window of 6 (max_window_layers=1).
    "qwen2_swa": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 7}),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with a gated shared expert.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [0],
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 32,
        },
    ),
    # Queries without compression, group-limited softmax routing.
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            **MLA,
            "q_lora_rank": None,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
    # Compressed queries, sigmoid routing with the correction bias, interleaved rotary pairs.
    "deepseek_v3": (
        "DeepseekV3Config",
        {**MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    ),
    # YaRN (mscale in the softmax scale) and rotate-half rotary.
    "deepseek_v3_yarn": (
        "DeepseekV3Config",
        {
            **MLA,
            "q_lora_rank": 24,
            "n_group": 2,
            "topk_group": 1,
            "rope_interleave": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
}

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v3_yarn")


def make_sparse_hf_model(family: str, seed: int = 0, sharpen: float = 1.0):
    """A random HF model of `family` in fp32, eager attention; `sharpen` scales lm_head (fewer argmax near-ties)."""
    import transformers

    cls_name, extra = SPARSE_FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms, biases and routers so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight"):  # routers: decisive scores, so no near-ties between experts
                p.copy_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


def save_sparse_hf_model(family: str, directory: Path, seed: int = 0, sharpen: float = 1.0):
    model = make_sparse_hf_model(family, seed, sharpen)
    model.save_pretrained(directory)
    return model

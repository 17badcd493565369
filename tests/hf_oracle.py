"""Tiny random HF checkpoints of each supported family, made by transformers (the oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# family -> (transformers config class name, extra config keys)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 1, "rope_theta": 100000.0}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1000000.0}),
    "mistral": ("MistralConfig", {"sliding_window": 8, "num_key_value_heads": 4}),
    "linear_rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "dynamic_rope": (
        "LlamaConfig",
        {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    "yarn_rope": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
}


def make_hf_model(family: str, seed: int = 0):
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_hf_model(family: str, directory: Path, seed: int = 0):
    model = make_hf_model(family, seed)
    model.save_pretrained(directory)
    return model

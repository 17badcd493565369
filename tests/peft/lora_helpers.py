"""Helpers shared by the LoRA tests."""

from __future__ import annotations

import torch

from posttrain.peft import lora_layers


def randomize_adapters(model, adapter: str = "default", seed: int = 0, std: float = 0.05) -> None:
    """Give every B (and A) of `adapter` random values, so the adapter changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            if adapter in layer.lora_A:
                for table in (layer.lora_A, layer.lora_B):
                    w = table[adapter].weight
                    w.copy_(torch.randn(w.shape, generator=gen) * std)


def random_ids(shape: tuple[int, ...], vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def hf_model(directory):
    """The transformers model of an HF directory, fp32, eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def randomize_peft(peft_model, seed: int = 0, adapter: str | None = None) -> None:
    """Random values for a peft model's LoRA weights (all adapters, or one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if (".lora_A." in name or ".lora_B." in name) and (adapter is None or f".{adapter}." in name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

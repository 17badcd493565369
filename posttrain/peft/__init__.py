"""LoRA adapters on the one model: apply, merge / unmerge in place, PEFT-format files both ways."""

from posttrain.peft.lora import (
    LoraConfig,
    active_adapter,
    adapter_names,
    apply_lora,
    delete_adapter,
    disable_adapters,
    has_adapters,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
    merge_and_unload,
    merge_lora,
    merged_adapter,
    set_adapter,
    trainable_parameters,
    unmerge_lora,
)
from posttrain.peft.lora_layer import LoRALinear
from posttrain.peft.peft_format import load_peft_adapter, read_adapter_config, save_peft_adapter

__all__ = [
    "LoRALinear",
    "LoraConfig",
    "active_adapter",
    "adapter_names",
    "apply_lora",
    "delete_adapter",
    "disable_adapters",
    "has_adapters",
    "load_lora_state_dict",
    "load_peft_adapter",
    "lora_layers",
    "lora_state_dict",
    "merge_and_unload",
    "merge_lora",
    "merged_adapter",
    "read_adapter_config",
    "save_peft_adapter",
    "set_adapter",
    "trainable_parameters",
    "unmerge_lora",
]

"""What a checkpoint holds of the model: the PEFT adapter (LoRA, QLoRA), a quantized export (the final
save of a QAT run) or an HF directory, decided by what the model holds (see posttrain.trainers.adapters
for how a trainer builds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.peft import has_adapters, save_peft_adapter
from posttrain.quant import FakeQuantLinear, convert_qat, save_quantized


def save_trained(model: nn.Module, tokenizer: Any, out: str | Path, *, base_model: str, export: bool = False) -> Path:
    """Write what the run trains into `out` (see the module docstring); `export` is the final save of a QAT
    run, which converts the model to real quantized layers in place. Returns `out`."""
    out = Path(out)
    if has_adapters(model):
        save_peft_adapter(model, out, base_model_name_or_path=base_model)
        if tokenizer is not None:
            tokenizer.save(out)  # the chat template the adapter was trained with travels with it
        return out
    if export and any(isinstance(m, FakeQuantLinear) for m in model.modules()):
        convert_qat(model)
        return save_quantized(model, out, tokenizer)
    return save_hf_dir(model, out, tokenizer=tokenizer)

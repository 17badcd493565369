"""What a trainer trains, and what it saves: full weights, LoRA, QLoRA or QAT, from the config's sections.

Every trainer config carries the same optional keys, and every trainer calls the functions here:

    lora:  {r: 16, ...}   only the LoRA adapters train (a `LoraConfig`); the base stays frozen
    quant: int4-g64       QLoRA: the decoder linears are quantized (frozen) before the adapters wrap them;
                          needs `lora:`
    qat:   int8           (SFT) quantization-aware training: the float weights train through fake
                          quantization and the run exports real quantized weights at the end

    load_trainable(cfg.model, lora=..., quant=..., qat=...)   -> (model, tokenizer), ready for the optimizer
    save_trained(model, tokenizer, path, ...)                  what a checkpoint holds of the model
                                                               (posttrain.checkpoint.model; the
                                                               Checkpointer calls it)
    save_final_dir(model, tokenizer, run_dir, ...)             <run>/final
    save_final_parallel(parallel, tokenizer, run_dir, ...)     <run>/final from the whole weights, by rank 0

What a save writes follows from what the model holds, so a trainer never branches on it:
- LoRA layers (LoRA and QLoRA): the PEFT adapter (adapter_config.json + adapter_model.safetensors) and
  the tokenizer. The base is not written: it is the model the run started from (`posttrain lora-merge`
  turns base + adapter into one HF directory).
- QAT layers: a checkpoint is the float weights (loads anywhere; a new run can start from it); the final
  save converts the layers to real int8 / int4 ones in place and writes a quantized directory
  (`save_quantized`), which `load_model`, `posttrain generate` and `posttrain eval ppl` read.
- anything else: an HF directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from posttrain.checkpoint.model import save_trained as save_trained  # re-exported: the trainers save through here
from posttrain.distributed.parallel import Parallel
from posttrain.distributed.processes import write_from_main
from posttrain.errors import ConfigError
from posttrain.models.hub import load_model
from posttrain.models.transformer import Transformer
from posttrain.peft import LoraConfig, apply_lora, set_adapter
from posttrain.peft import has_adapters as has_adapters  # re-exported, as before
from posttrain.peft.lora import DEFAULT_ADAPTER, find_targets, wrap_linear
from posttrain.quant import SCHEMES, prepare_qat, quantize_model
from posttrain.run_dir import final_dir
from posttrain.trainers.sections import ModelSection


def check_adapter_options(lora: LoraConfig | None, quant: str | None, qat: str | None = None) -> None:
    """Refuse a combination of `lora:`, `quant:` and `qat:` that cannot train; ValueError naming the keys.

    A config's `validate()` calls this, so `load_config` reports it (with the file) before any compute."""
    schemes = ", ".join(SCHEMES)
    if qat is not None:
        if qat not in SCHEMES:
            raise ValueError(f"qat: unknown quantization scheme {qat!r} (choose from {schemes})")
        if quant is not None:
            raise ValueError(
                "qat and quant cannot be combined: quant: is the frozen quantized base of QLoRA, "
                "qat: trains float weights and quantizes them at the end"
            )
        if lora is not None:
            # QAT moves every weight toward the quantization grid; LoRA freezes them. Fake-quantizing the
            # base under the adapters would train adapters for a grid the base never moves on: not QAT.
            raise ValueError(
                "qat and lora cannot be combined: QAT trains the full weights through fake "
                "quantization, LoRA freezes them (for adapters over a quantized base use quant:, QLoRA)"
            )
    if quant is not None:
        if quant not in SCHEMES:
            raise ValueError(f"quant: unknown quantization scheme {quant!r} (choose from {schemes})")
        if lora is None:
            # A quantized layer has no trainable weights: without adapters nothing would train.
            raise ValueError(
                f"quant={quant!r} needs a lora: section (QLoRA trains LoRA adapters over the frozen "
                "quantized base); add e.g. `lora: {r: 16}` or lora.r=16"
            )


def prepare_trainable(
    model: nn.Module, *, lora: LoraConfig | None = None, quant: str | None = None, qat: str | None = None
) -> nn.Module:
    """Make `model` (fresh from `load_model`) what the run trains, in place; build the optimizer after this.

    lora: adapters on, everything else frozen. quant + lora: the decoder linears quantized, then adapters
    around them. qat: decoder linears fake-quantized (same Parameters, all trainable). None: unchanged.
    """
    try:
        check_adapter_options(lora, quant, qat)
    except ValueError as error:  # a config built in Python skips load_config's validation
        raise ConfigError(str(error)) from None
    if qat is not None:
        return prepare_qat(model, qat)
    if lora is None:
        return model
    if quant is None:
        return apply_lora(model, lora)
    return _apply_qlora(model, lora, quant)


def _apply_qlora(model: nn.Module, lora: LoraConfig, scheme: str) -> nn.Module:
    """quantize_model, then LoRA adapters around the targeted layers (QuantizedLinear or, e.g. an untied
    lm_head, nn.Linear).

    `apply_lora` selects its targets among nn.Linear layers only, and `quantize_model` refuses a layer that
    LoRA already wraps. So the targets are resolved on the float model, with apply_lora's own matching rules
    and error messages, before quantizing; then each is wrapped. LoRALinear reads only `weight` (device,
    dtype), `in_features` and `out_features` of its base, which QuantizedLinear has (adapters are fp32 over
    an integer weight), and it refuses to merge into a quantized weight.
    """
    try:
        lora.validate()
    except ValueError as error:
        raise ConfigError(f"lora: {error}") from None
    targets = find_targets(model, lora.target_modules, lora.exclude_modules, source="lora", error=ConfigError)
    quantize_model(model, scheme)
    model.requires_grad_(False)  # embeddings, norms (and an untargeted lm_head) stay frozen, as with apply_lora
    for name in targets:
        layer = wrap_linear(model, name)
        layer.add_adapter(DEFAULT_ADAPTER, lora.r, lora.alpha, lora.dropout, lora.use_rslora, lora.init)
    set_adapter(model, DEFAULT_ADAPTER)
    return model


def load_trainable(
    section: ModelSection, *, lora: LoraConfig | None = None, quant: str | None = None, qat: str | None = None
) -> tuple[Transformer, Any]:
    """(model, tokenizer): `section`'s model, loaded and prepared (`prepare_trainable`).

    The options are checked before the model loads, so a bad combination costs no compute."""
    try:
        check_adapter_options(lora, quant, qat)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    model, tokenizer = load_model(
        section.name_or_path, dtype=section.dtype, device=section.device, chat_template=section.chat_template
    )
    return prepare_trainable(model, lora=lora, quant=quant, qat=qat), tokenizer


def save_final_dir(model: nn.Module, tokenizer: Any, run_dir: str | Path, *, base_model: str) -> Path:
    """<run>/final: the adapter (LoRA, QLoRA), the quantized export (QAT) or the HF directory."""
    return save_trained(model, tokenizer, final_dir(run_dir), base_model=base_model, export=True)


def save_final_parallel(parallel: Parallel, tokenizer: Any, run_dir: str | Path, *, base_model: str) -> Path:
    """<run>/final from the whole weights, written by rank 0 (the others wait for it): what `save_final_dir`
    writes in a single process."""
    write_from_main(parallel, lambda model: save_final_dir(model, tokenizer, run_dir, base_model=base_model))
    return final_dir(run_dir)

"""Quantized model directories: HF-style (config.json + model.safetensors + tokenizer), written atomically.

config.json is the model's own plus a `quantization_config` section (`QuantScheme.to_config`); the
safetensors file holds each quantized layer as `<hf name>.qweight` / `.scales` / `.zeros` (asymmetric) /
`.bias`, and every other tensor (embeddings, norms) in its float dtype. Which layers are quantized is read
from the tensor names, so a directory describes itself.

`hub.load_model` reads these directories through the format posttrain/__init__.py registers with models
(`models.dir_formats`): models itself never imports quant.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.errors import CheckpointError
from posttrain.models.checkpoint_io import ours_to_hf, read_hf_config, read_our_tensors, save_hf_dir
from posttrain.models.dir_formats import declares_quantization
from posttrain.models.transformer import Transformer
from posttrain.quant.linear import QuantizedLinear, replace_module
from posttrain.quant.schemes import FORMAT_VERSION, INT4_LAYOUT, QUANT_METHOD, SCHEMES, QuantScheme

if TYPE_CHECKING:
    from posttrain.tokenizer import Tokenizer

QUANTIZED_BUFFERS = ("qweight", "scales", "zeros", "bias")


def save_quantized(model: Transformer, out: str | Path, tokenizer: Any | None = None) -> Path:
    """Write a quantized model (from `quantize_model` or `convert_qat`) as a directory; returns `out`."""
    if not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise CheckpointError("save_quantized: the model has no quantized layers (run quantize_model first)")
    if "quantization_config" not in model.config.extra:
        raise CheckpointError("save_quantized: model.config has no quantization_config (set by quantize_model)")
    return save_hf_dir(model, out, tokenizer=tokenizer)


def is_quantized_dir(path: str | Path) -> bool:
    """True for a directory whose config.json has a `quantization_config` section (load it with
    `load_quantized_dir`, which explains any it cannot read)."""
    return declares_quantization(path)


def scheme_from_config(section: Any, source: str) -> QuantScheme:
    """The QuantScheme a `quantization_config` section names, checked field by field against the registry."""
    if not isinstance(section, dict):
        raise CheckpointError(f"{source}: quantization_config must be a JSON object, got {type(section).__name__}")
    method = section.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(
            f"{source}: quantization_config.quant_method={method!r} is not supported "
            f"(only {QUANT_METHOD!r}, written by `posttrain quantize`)"
        )
    version = section.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{source}: quantization_config.format_version={version!r} (this version reads {FORMAT_VERSION})"
        )
    name = section.get("scheme")
    if name not in SCHEMES:
        raise CheckpointError(f"{source}: quantization_config.scheme={name!r} is unknown (known: {', '.join(SCHEMES)})")
    scheme = SCHEMES[name]
    if scheme.bits == 4 and section.get("int4_layout") != INT4_LAYOUT:
        raise CheckpointError(f"{source}: int4_layout={section.get('int4_layout')!r} (readable: {INT4_LAYOUT!r})")
    for key, expected in scheme.to_config().items():
        if key in ("modules_not_converted",):
            continue
        if section.get(key) != expected:
            raise CheckpointError(
                f"{source}: quantization_config.{key}={section.get(key)!r} contradicts scheme "
                f"{name!r} ({key}={expected!r})"
            )
    return scheme


def load_quantized_dir(
    path: str | Path,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype | None = None,
    compute: str = "auto",
) -> Transformer:
    """Build the quantized Transformer a directory holds (eval mode). `dtype` applies to the float tensors
    (embeddings, norms, biases; default: as stored); quantized tensors load as they are."""
    path = Path(path)
    source = str(path / "config.json")
    cfg = read_hf_config(path)
    scheme = scheme_from_config(cfg.extra.get("quantization_config"), source)
    tensors = read_our_tensors(path)
    model = Transformer(cfg, device="meta")
    quantized = sorted(n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight"))
    if not quantized:
        raise CheckpointError(
            f"{path}: config.json declares quantization but model.safetensors has no .qweight tensors"
        )
    for name in quantized:
        _install_shell(model, name, scheme, tensors, str(path), compute)
    expected = dict(model.state_dict(keep_vars=True))
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state = {}
    for name, tensor in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {ours_to_hf(name)!r} for a {cfg.model_type} model")
        _check_tensor(name, tensor, expected[name], str(path))
        is_float_state = tensor.is_floating_point() and not name.endswith((".scales", ".zeros"))
        state[name] = tensor.to(dtype) if (dtype is not None and is_float_state) else tensor
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{path}: missing tensors {', '.join(ours_to_hf(m) for m in missing[:3])}{more}")
    for name in quantized:
        scales = state[f"{name}.scales"]
        if not bool(torch.isfinite(scales).all()) or bool((scales == 0).any()):
            raise CheckpointError(f"{path}: {ours_to_hf(name)}.scales holds non-finite or zero values (corrupt file)")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval()


def _install_shell(
    model: Transformer, name: str, scheme: QuantScheme, tensors: dict, source: str, compute: str
) -> None:
    """Put an empty QuantizedLinear (on meta) where the float linear `name` is."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(
            f"{source}: quantized tensor {ours_to_hf(name)}.qweight names no layer of the model"
        ) from None
    if not isinstance(linear, nn.Linear):
        raise CheckpointError(f"{source}: {ours_to_hf(name)} is a {type(linear).__name__}, not a linear layer")
    stored_bias = tensors.get(f"{name}.bias")
    bias_dtype = stored_bias.dtype if stored_bias is not None and stored_bias.is_floating_point() else torch.float32
    shell = QuantizedLinear(
        linear.in_features,
        linear.out_features,
        scheme,
        bias=linear.bias is not None,
        device="meta",
        bias_dtype=bias_dtype,
        compute=compute,
    )
    replace_module(model, name, shell)


def _check_tensor(name: str, tensor: torch.Tensor, expected: torch.Tensor, source: str) -> None:
    hf_name = ours_to_hf(name)
    if tuple(tensor.shape) != tuple(expected.shape):
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config and "
            f"scheme imply {tuple(expected.shape)}"
        )
    quantized_state = name.endswith((".qweight", ".scales", ".zeros"))
    if quantized_state and tensor.dtype != expected.dtype:
        raise CheckpointError(f"{source}: tensor {hf_name!r} is {tensor.dtype}, the scheme stores {expected.dtype}")
    if not quantized_state and not tensor.is_floating_point():
        raise CheckpointError(f"{source}: tensor {hf_name!r} is {tensor.dtype}, expected a float tensor")


def load_quantized(
    path: str | Path, device: str | torch.device | None = "cpu", dtype: torch.dtype | None = None
) -> tuple[Transformer, Tokenizer]:
    """(model, tokenizer) from a quantized directory."""
    from posttrain.models.hub import load_tokenizer

    return load_quantized_dir(path, device, dtype), load_tokenizer(Path(path))

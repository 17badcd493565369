"""Read a llama.cpp GGUF file into Hugging Face form: a config.json dict and HF-named fp32 tensors.

A GGUF carries no config.json: its metadata (under llama.cpp's key names, prefixed by the
architecture, e.g. `llama.block_count`) is the config. Its tensors use llama.cpp names
(`blk.0.attn_q.weight`), may be block-quantized (Q4_1, Q8_0, K-quants, ...), and for the llama
architecture the q/k rows are stored in a different order than HF's (see `_unpermute_rope_rows`)
and Llama 3 rope scaling is a tensor of per-frequency divisors (see `_llama3_rope_scaling`).

`read_gguf` undoes all of these, so the rest of posttrain only ever sees HF names and HF layouts.
Nothing here unpickles: the `gguf` package reads the file as a numpy memmap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.errors import CheckpointError

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in HF terms.

    config: an HF `config.json` dict (e.g. for `LlamaForCausalLM`).
    tensors: HF name -> fp32 tensor in HF layout ([out, in] for linears).
    tokenizer_meta: every `tokenizer.*` metadata key, with plain Python values
        (e.g. `tokenizer.ggml.tokens` -> list[str]); `tokenizer_from_gguf` builds a tokenizer from it.
    """

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto an HF model class."""

    hf_architecture: str
    model_type: str
    # llama.cpp runs llama with interleaved-pair rope, so its converter reorders q/k rows; qwen
    # models run with HF's half-split ("neox") rope and are stored as-is.
    permute_qk: bool
    # Per-layer tensors this architecture must have beyond `COMMON_LAYER_TENSORS`.
    extra_layer_tensors: tuple[str, ...] = ()


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": ArchSpec(
        "Qwen2ForCausalLM",
        "qwen2",
        permute_qk=False,
        extra_layer_tensors=("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    ),
    "qwen3": ArchSpec(
        "Qwen3ForCausalLM",
        "qwen3",
        permute_qk=False,
        extra_layer_tensors=("attn_q_norm.weight", "attn_k_norm.weight"),
    ),
}

# GGUF name -> (HF name, HF shape in named dims). `{i}` is the layer index. The dims are resolved
# from the config by `_expected_shape`, so a file whose tensors disagree with its metadata fails here.
GGUF_TO_HF: dict[str, tuple[str, tuple[str, ...]]] = {
    "token_embd.weight": ("model.embed_tokens.weight", ("vocab", "hidden")),
    "output_norm.weight": ("model.norm.weight", ("hidden",)),
    "output.weight": ("lm_head.weight", ("vocab", "hidden")),
    "blk.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight", ("hidden",)),
    "blk.{i}.attn_q.weight": ("model.layers.{i}.self_attn.q_proj.weight", ("q_dim", "hidden")),
    "blk.{i}.attn_k.weight": ("model.layers.{i}.self_attn.k_proj.weight", ("kv_dim", "hidden")),
    "blk.{i}.attn_v.weight": ("model.layers.{i}.self_attn.v_proj.weight", ("kv_dim", "hidden")),
    "blk.{i}.attn_output.weight": ("model.layers.{i}.self_attn.o_proj.weight", ("hidden", "q_dim")),
    "blk.{i}.attn_q.bias": ("model.layers.{i}.self_attn.q_proj.bias", ("q_dim",)),
    "blk.{i}.attn_k.bias": ("model.layers.{i}.self_attn.k_proj.bias", ("kv_dim",)),
    "blk.{i}.attn_v.bias": ("model.layers.{i}.self_attn.v_proj.bias", ("kv_dim",)),
    "blk.{i}.attn_output.bias": ("model.layers.{i}.self_attn.o_proj.bias", ("hidden",)),
    "blk.{i}.attn_q_norm.weight": ("model.layers.{i}.self_attn.q_norm.weight", ("head_dim",)),
    "blk.{i}.attn_k_norm.weight": ("model.layers.{i}.self_attn.k_norm.weight", ("head_dim",)),
    "blk.{i}.ffn_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight", ("hidden",)),
    "blk.{i}.ffn_gate.weight": ("model.layers.{i}.mlp.gate_proj.weight", ("ffn", "hidden")),
    "blk.{i}.ffn_up.weight": ("model.layers.{i}.mlp.up_proj.weight", ("ffn", "hidden")),
    "blk.{i}.ffn_down.weight": ("model.layers.{i}.mlp.down_proj.weight", ("hidden", "ffn")),
}

COMMON_GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight")
COMMON_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)

# GGUF tensor name stem -> the config field giving the head count its rows were permuted with.
QK_PERMUTE_HEADS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}

# llama.cpp's Llama 3.x rope scaling: one divisor per rotary frequency instead of metadata keys.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# The parameters Meta published for Llama 3.1 / 3.2 (only `factor` differs between them); llama.cpp's
# converter also assumes this original context when a config does not say.
LLAMA3_ORIGINAL_CONTEXT = 8192
LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read a GGUF checkpoint: metadata -> HF config, tensors -> HF names, fp32, HF layout.

    Raises CheckpointError (one line naming the file and the problem) on anything it cannot read.
    """
    path = Path(path)
    reader = _open_reader(path)
    metadata = _read_metadata(reader)
    tokenizer_meta = {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
    tensor_names = [tensor.name for tensor in reader.tensors]
    rope_freqs = [_dequantize(tensor, path) for tensor in reader.tensors if tensor.name == ROPE_FREQS_TENSOR]
    config = gguf_config(metadata, tensor_names, path, rope_freqs[0] if rope_freqs else None)
    spec = ARCHITECTURES[metadata["general.architecture"]]
    _check_tensor_set(tensor_names, spec, config["num_hidden_layers"], path)

    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # folded into config["rope_scaling"]
        hf_name, dims = _hf_name(tensor.name, path)
        weights = _dequantize(tensor, path)  # HF orientation already: numpy shape is GGUF's reversed
        stem = tensor.name.split(".")[-2]
        if spec.permute_qk and stem in QK_PERMUTE_HEADS:
            weights = _unpermute_rope_rows(weights, config[QK_PERMUTE_HEADS[stem]], tensor.name, path)
        expected = _expected_shape(dims, config)
        if tuple(weights.shape) != expected:
            raise CheckpointError(
                f"{path}: tensor {tensor.name} has shape {tuple(weights.shape)}, the metadata implies {expected}"
            )
        tensors[hf_name] = torch.from_numpy(weights)
    return GGUFCheckpoint(config=config, tensors=tensors, tokenizer_meta=tokenizer_meta)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the metadata (config and tokenizer keys), without touching the tensors: what a tokenizer needs."""
    return _read_metadata(_open_reader(Path(path)))


def gguf_config(
    metadata: dict[str, Any],
    tensor_names: list[str],
    path: Path | str = "<gguf>",
    rope_freqs: np.ndarray | None = None,
) -> dict[str, Any]:
    """The HF config.json dict for a GGUF file's metadata (keys as llama.cpp writes them).

    `rope_freqs` is the `rope_freqs.weight` tensor (head_dim/2,) when the file has one: llama.cpp's
    form of Llama 3.x rope scaling, turned back into HF's `rope_scaling` here.
    """
    arch = _require(metadata, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    spec = ARCHITECTURES[arch]

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{name}"
        if full in metadata:
            value = metadata[full]
            if isinstance(value, list):
                raise CheckpointError(f"{path}: per-layer values in {full} are not supported")
            return value
        if required:
            raise CheckpointError(f"{path}: missing required metadata key {full}")
        return default

    def size(name: str, default: Any = None, required: bool = True) -> int:
        value = key(name, default, required)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{path}: {arch}.{name} = {value!r} is not a positive integer")
        return value

    hidden = size("embedding_length")
    num_heads = size("attention.head_count")
    num_kv_heads = size("attention.head_count_kv", num_heads, required=False)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"{path}: {arch}.attention.head_count ({num_heads}) is not a multiple of "
            f"{arch}.attention.head_count_kv ({num_kv_heads})"
        )
    head_dim = size("attention.key_length", hidden // num_heads, required=False)
    rope_dims = key("rope.dimension_count", head_dim, required=False)
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{path}: partial rotary ({arch}.rope.dimension_count={rope_dims}, head_dim={head_dim}) is not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" not in metadata and tokens is None:
        raise CheckpointError(f"{path}: missing metadata key {arch}.vocab_size (and no tokenizer.ggml.tokens)")
    vocab_size = size("vocab_size", len(tokens or ()), required=False)
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length"),
        "num_hidden_layers": size("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0, required=False),
        "max_position_embeddings": size("context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(metadata, arch, path)
    if rope_freqs is not None:
        original_context = metadata.get(f"{arch}.rope.scaling.original_context_length", LLAMA3_ORIGINAL_CONTEXT)
        rope_scaling = _llama3_rope_scaling(rope_freqs, config["rope_theta"], head_dim, original_context, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(metadata: dict[str, Any], arch: str, path: Path | str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (or the older `{arch}.rope.scale_linear`)."""
    prefix = f"{arch}.rope.scaling."
    scaling_type = metadata.get(prefix + "type")
    factor = metadata.get(prefix + "factor")
    if scaling_type is None and f"{arch}.rope.scale_linear" in metadata:
        scaling_type, factor = "linear", metadata[f"{arch}.rope.scale_linear"]
    if scaling_type in (None, "none"):
        return None
    if factor is None:
        raise CheckpointError(f"{path}: missing metadata key {prefix}factor")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if scaling_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        optional = {
            "original_context_length": "original_max_position_embeddings",
            "yarn_beta_fast": "beta_fast",
            "yarn_beta_slow": "beta_slow",
        }
        scaling.update(
            {hf: metadata[prefix + gguf_key] for gguf_key, hf in optional.items() if prefix + gguf_key in metadata}
        )
        return scaling
    raise CheckpointError(
        f"{path}: unsupported rope scaling type {scaling_type!r} in {prefix}type (supported: none, linear, yarn)"
    )


def _llama3_rope_scaling(
    rope_freqs: np.ndarray, theta: float, head_dim: int, original_context: int, path: Path | str
) -> dict[str, Any] | None:
    """HF's llama3 `rope_scaling` from llama.cpp's per-frequency divisors (head_dim/2,).

    The divisors follow HF's curve: 1 for short wavelengths, `factor` for long ones, and between
    them 1 / ((1 - s) / factor + s) with s linear in 1/wavelength. `factor` is the largest divisor.
    We try Meta's published low/high factors, then a line fitted through the ramp, and keep the
    first that reproduces every divisor (a file that fits neither is refused, not guessed).
    """
    divisors = rope_freqs.astype(np.float64).reshape(-1)
    if divisors.shape != (head_dim // 2,):
        raise CheckpointError(f"{path}: {ROPE_FREQS_TENSOR} has {divisors.size} values, expected {head_dim // 2}")
    factor = float(str(np.float32(divisors.max())))
    if np.allclose(divisors, 1.0):
        return None
    inv_wavelength = theta ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * np.pi)  # (head_dim/2,)
    candidates = [dict(LLAMA3_FREQ_FACTORS)]
    on_ramp = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if on_ramp.sum() >= 2:
        # s = (original_context * inv_wavelength - low) / (high - low): a line in inv_wavelength
        smooth = (1 / divisors[on_ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelength[on_ramp], smooth, 1)
        span = original_context / slope
        low = -intercept * span
        candidates.append({"low_freq_factor": float(f"{low:.6g}"), "high_freq_factor": float(f"{low + span:.6g}")})
    for candidate in candidates:
        low, high = candidate["low_freq_factor"], candidate["high_freq_factor"]
        smooth = (original_context * inv_wavelength - low) / (high - low)
        expected = np.where(
            inv_wavelength > high / original_context,
            1.0,  # wavelength < original_context / high
            np.where(inv_wavelength < low / original_context, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(expected, divisors, rtol=1e-4, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                **candidate,
                "original_max_position_embeddings": original_context,
            }
    raise CheckpointError(f"{path}: {ROPE_FREQS_TENSOR} does not follow llama3 rope scaling; cannot convert it")


def _open_reader(path: Path) -> Any:
    """A `gguf.GGUFReader` over `path`, or CheckpointError saying why the file is not a GGUF."""
    import gguf  # the package imports numpy-heavy modules; keep it off the posttrain import path

    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as error:  # the reader raises ValueError/IndexError/... on short or bad data
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({type(error).__name__}: {error})") from error
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
    return reader


def _read_metadata(reader: Any) -> dict[str, Any]:
    """Metadata key -> plain Python value (str, int, float, bool, or a list of those)."""
    import gguf

    metadata: dict[str, Any] = {}
    for name, reader_field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header's own counts, not metadata
        value = reader_field.contents()
        if reader_field.types == [gguf.GGUFValueType.FLOAT32]:
            # float32 1e-5 widens to 9.999999747e-06; give back the decimal the author wrote
            value = float(str(np.float32(value)))
        metadata[name] = value
    return metadata


def _require(metadata: dict[str, Any], key: str, path: Path | str) -> Any:
    if key not in metadata:
        raise CheckpointError(f"{path}: missing required metadata key {key}")
    return metadata[key]


def _hf_name(gguf_name: str, path: Path) -> tuple[str, tuple[str, ...]]:
    """GGUF tensor name -> (HF name, named dims), through the `GGUF_TO_HF` table."""
    layer = _LAYER_NAME.fullmatch(gguf_name)
    pattern = f"blk.{{i}}.{layer.group(2)}" if layer else gguf_name
    if pattern not in GGUF_TO_HF:
        raise CheckpointError(f"{path}: unexpected tensor {gguf_name}")
    hf_pattern, dims = GGUF_TO_HF[pattern]
    return (hf_pattern.format(i=layer.group(1)) if layer else hf_pattern), dims


def _check_tensor_set(tensor_names: list[str], spec: ArchSpec, num_layers: int, path: Path) -> None:
    """Every tensor the architecture needs is present, and no layer index is out of range."""
    present = set(tensor_names)
    layer_tensors = COMMON_LAYER_TENSORS + spec.extra_layer_tensors
    required = list(COMMON_GLOBAL_TENSORS) + [
        f"blk.{i}.{suffix}" for i in range(num_layers) for suffix in layer_tensors
    ]
    missing = [name for name in required if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]}{more}")
    for name in tensor_names:
        layer = _LAYER_NAME.fullmatch(name)
        if layer and int(layer.group(1)) >= num_layers:
            raise CheckpointError(f"{path}: tensor {name} is past block_count={num_layers}")


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """One tensor as an owned fp32 array in numpy (= HF) order: GGUF lists dims innermost-first."""
    from gguf import GGMLQuantizationType as QType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF [in, out] -> HF [out, in]
    if qtype in (QType.F32, QType.F64, QType.F16):
        weights = np.asarray(tensor.data).astype(np.float32)  # always a copy off the memmap
    else:
        try:
            weights = dequantize(np.asarray(tensor.data), qtype)
        except NotImplementedError as error:
            raise CheckpointError(
                f"{path}: tensor {tensor.name} has unsupported quantization type {qtype.name}"
            ) from error
        weights = np.ascontiguousarray(weights, dtype=np.float32)
    return weights.reshape(shape)


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int, name: str, path: Path) -> np.ndarray:
    """Undo llama.cpp's q/k row order for one projection: (num_heads * head_dim, ...) -> same shape.

    HF llama rotates the two halves of each head (dims j and j + head_dim/2 form a pair); llama.cpp
    rotates adjacent dims (2j, 2j+1). Its converter therefore reorders each head's rows from
    [half0 | half1] to [h0[0], h1[0], h0[1], h1[1], ...], i.e. views a head as (2, head_dim/2) and
    transposes it. k_proj uses the kv head count. Here we view each head as (head_dim/2, 2) and
    transpose back. Works for weights (rows, in) and biases (rows,).
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    if half * 2 * num_heads != rows:
        raise CheckpointError(f"{path}: tensor {name} has {rows} rows, which do not split into {num_heads} rope heads")
    per_head = weights.reshape(num_heads, half, 2, *weights.shape[1:])  # (H, D/2, 2, ...)
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weights.shape)  # (H, 2, D/2, ...) -> rows


def _expected_shape(dims: tuple[str, ...], config: dict[str, Any]) -> tuple[int, ...]:
    sizes = {
        "vocab": config["vocab_size"],
        "hidden": config["hidden_size"],
        "ffn": config["intermediate_size"],
        "head_dim": config["head_dim"],
        "q_dim": config["num_attention_heads"] * config["head_dim"],
        "kv_dim": config["num_key_value_heads"] * config["head_dim"],
    }
    return tuple(sizes[dim] for dim in dims)

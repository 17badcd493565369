"""posttrain: post-training for decoder-only LLMs.

The public face. Names are imported on first use, so `import posttrain` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from posttrain.models.transformer import Transformer

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "load_model": "posttrain.models.hub",
    "resolve_model_path": "posttrain.models.hub",
    "Transformer": "posttrain.models.transformer",
    "ModelConfig": "posttrain.models.config",
    "save_hf_dir": "posttrain.models.checkpoint_io",
    "Tokenizer": "posttrain.tokenizer",
    "LLM": "posttrain.engine.llm",
    "SamplingParams": "posttrain.engine.sampling_params",
    "PosttrainError": "posttrain.errors",
}

__all__ = sorted(_EXPORTS)


def _load_quantized_dir(path: Path, device: torch.device, dtype: torch.dtype | None) -> Transformer:
    from posttrain.quant.io import load_quantized_dir

    return load_quantized_dir(path, device=device, dtype=dtype)


def _register_dir_formats() -> None:
    """Wire the directory formats other packages write into models' loader (models imports none of them):
    here, because every import of a posttrain module runs this file first. Matching reads config.json only,
    and quant is imported when such a directory is loaded, so `import posttrain` stays light."""
    from posttrain.models.dir_formats import DirFormat, declares_quantization, register_dir_format

    register_dir_format(DirFormat("posttrain quantize directory", declares_quantization, _load_quantized_dir))


_register_dir_formats()


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

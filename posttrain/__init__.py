"""posttrain: post-training for decoder-only LLMs.

The public face. Names are imported on first use, so `import posttrain` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

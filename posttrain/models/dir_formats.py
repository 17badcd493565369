"""Checkpoint directory formats beyond plain HF weights, which packages above models know how to load.

`hub.load_model` reads HF directories (and GGUF files, converted to one) itself. A directory in another
format (a `posttrain quantize` one) goes to the `DirFormat` registered for it: the top-level package
(posttrain/__init__.py) registers posttrain.quant's loader, so the dependency points into models and
models imports no quant. This module stays light (no torch at import): `import posttrain` runs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from posttrain.models.transformer import Transformer


@dataclass(frozen=True)
class DirFormat:
    """One directory format: `matches(path)` says whether a directory is one (cheap: no weights read);
    `load(path, device, dtype)` builds its model in eval mode (`dtype` None: the float dtype as stored)."""

    name: str  # what such a directory is; a registration under the same name replaces the old one
    matches: Callable[[Path], bool]
    load: Callable[[Path, torch.device, torch.dtype | None], Transformer]


_FORMATS: dict[str, DirFormat] = {}


def register_dir_format(fmt: DirFormat) -> None:
    _FORMATS[fmt.name] = fmt


def dir_format(path: Path) -> DirFormat | None:
    """The registered format that matches the directory at `path`, or None (a plain HF directory)."""
    return next((fmt for fmt in _FORMATS.values() if fmt.matches(path)), None)


def declares_quantization(path: str | Path) -> bool:
    """True for a directory whose config.json has a `quantization_config` section (HF's key for a
    quantized checkpoint); False when there is no readable config.json (the HF loader reports that)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return False
    return isinstance(config, dict) and "quantization_config" in config

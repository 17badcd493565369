"""Where posttrain keeps what it converts or builds once and reuses: models converted from GGUF
(models.hub) and compiled CPU kernels. A leaf: it imports nothing of ours, so both can use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted models and built CPU kernels live: $POSTTRAIN_CACHE, else ~/.cache/posttrain."""
    return Path(os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain")

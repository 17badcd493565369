"""Which kernel attends over the KV pool: EngineConfig.attention_backend resolved once, when the runner
starts, against the model's device, dtype and the pool's block size (docs/engine.md "Attention backends").
The model runs the named kernel (posttrain/models/paged_attention.py, `PAGED_BACKENDS`)."""

from __future__ import annotations

import torch

from posttrain.errors import PosttrainError
from posttrain.models import paged_flash

ATTENTION_BACKENDS = ("auto", "cpu", "reference", "flex", "flash")
FLEX_BLOCK_MULTIPLE = 16  # FlexAttention's Triton tiles: at least 16 keys, and a KV block holds whole tiles


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """The concrete backend for `requested`; a backend that cannot run here fails with the reason."""
    if requested == "auto":
        if device.type == "cpu":
            return "cpu"  # the C kernels (or their PyTorch cascade): CPU behaviour as before
        if device.type != "cuda":
            return "reference"
        return "flash" if _flash_problem(device, dtype, block_size) is None else "flex"
    problem = None
    if requested == "cpu" and device.type != "cpu":
        problem = f"the model is on {device}"
    elif requested == "flex" and device.type == "cuda" and block_size % FLEX_BLOCK_MULTIPLE:
        problem = f"on CUDA it needs block_size a multiple of {FLEX_BLOCK_MULTIPLE} (it is {block_size})"
    elif requested == "flash":
        problem = _flash_problem(device, dtype, block_size)
    if problem is not None:
        raise PosttrainError(f"attention_backend={requested!r} cannot run: {problem}")
    return requested


def _flash_problem(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why flash-attn's paged kernels cannot run here, or None."""
    if device.type != "cuda":
        return f"flash-attn runs on CUDA only (the model is on {device})"
    if not paged_flash.available():
        return "the flash_attn package is not installed"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn takes float16 or bfloat16 (the model is {dtype})"
    if block_size % paged_flash.BLOCK_MULTIPLE:
        return f"flash-attn 2 needs block_size a multiple of {paged_flash.BLOCK_MULTIPLE} (it is {block_size})"
    return None

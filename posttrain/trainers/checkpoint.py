"""Model saves during and after training, as HF directories (`save_hf_dir`, atomic).

    <run>/checkpoints/step-N/   every train.save_every steps (the oldest pruned past keep_last)
    <run>/final/                the trained model with its tokenizer

Both load with `posttrain.load_model(path)` and `transformers.AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.run_dir import final_dir

CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the run's checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def save_checkpoint(
    model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, step: int, keep_last: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save the model at `step`; with `keep_last`, delete all but the newest `keep_last` checkpoints."""
    path = save_hf_dir(model, checkpoint_dir(run_dir, step), tokenizer=tokenizer, dtype=dtype)
    if keep_last is not None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def save_final(model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    return save_hf_dir(model, final_dir(run_dir), tokenizer=tokenizer, dtype=dtype)

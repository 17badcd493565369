"""Checkpoint directories of a run: their layout, the commit marker, rotation and finding the newest.

    <run>/checkpoints/step-N/   every train.save_every steps (the oldest pruned past keep_checkpoints)
    <run>/final/                the trained model with its tokenizer

A step directory is written whole into a hidden sibling (`.step-N.partial`), renamed into place, and
only then marked with a `COMMITTED` file (fsync'd). A directory without the marker was cut short by a
crash: resuming skips it with a warning, and rotation never counts it. `checkpoint.state.Checkpointer`
writes the full training state this way; `save_checkpoint` below is the older model-only save.

Both kinds load with `posttrain.load_model(path)` (or as a PEFT adapter with LoRA).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.run_dir import final_dir

logger = logging.getLogger("posttrain.trainers")

CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step}"


def partial_dir(run_dir: str | Path, step: int) -> Path:
    """Where step N is assembled before it is renamed into place (hidden: never listed as a checkpoint)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".step-{step}.partial"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the run's step directories, committed or not, oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def is_committed(path: str | Path) -> bool:
    return (Path(path) / COMMIT_MARKER).is_file()


def committed_checkpoints(run_dir: str | Path, warn: bool = False) -> list[tuple[int, Path]]:
    """(step, path) of the committed checkpoints, oldest first; with `warn`, each torn one is reported."""
    out = []
    for step, path in list_checkpoints(run_dir):
        if is_committed(path):
            out.append((step, path))
        elif warn:
            logger.warning("%s: no %s marker (its write was interrupted): skipped", path, COMMIT_MARKER)
    return out


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest committed checkpoint of the run, or None; torn ones are skipped with a warning."""
    found = committed_checkpoints(run_dir, warn=True)
    return found[-1] if found else None


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path` and the directories themselves, so a commit marker written next
    cannot reach the disk before the data it vouches for."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def commit(path: Path, text: str = "") -> None:
    """Write the marker that makes `path` a checkpoint to resume from; the last write of a save."""
    marker = path / COMMIT_MARKER
    with open(marker, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path)


def prune_checkpoints(run_dir: str | Path, keep_last: int | None) -> None:
    """Delete all but the newest `keep_last` committed checkpoints, and torn ones older than the newest
    committed one (leftovers of a crash). Call only after the new checkpoint is committed."""
    committed = committed_checkpoints(run_dir)
    if not committed:
        return
    newest = committed[-1][0]
    doomed = [path for step, path in list_checkpoints(run_dir) if step < newest and not is_committed(path)]
    if keep_last is not None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        doomed += [path for _, path in committed[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer: Any,
    run_dir: str | Path,
    step: int,
    keep_last: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save the model only (no optimizer or RNG state) at `step`; with `keep_last`, delete all but the newest
    `keep_last` step directories. Trainers use `checkpoint.state.Checkpointer`, which can be resumed from."""
    path = save_hf_dir(model, checkpoint_dir(run_dir, step), tokenizer=tokenizer, dtype=dtype)
    if keep_last is not None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def save_final(model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    return save_hf_dir(model, final_dir(run_dir), tokenizer=tokenizer, dtype=dtype)

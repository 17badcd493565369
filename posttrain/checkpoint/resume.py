"""`resume: auto | PATH` (CLI `--resume auto`): which run directory a trainer writes into, and which
checkpoint it continues from.

    auto   the newest committed checkpoint of the run in `out` (torn ones skipped with a warning);
           with none there, the run starts at step 0, so a job script can always pass --resume auto
    PATH   that checkpoint directory (it must be committed); the run directory is `out` if given,
           else the run the checkpoint belongs to (PATH/../..)

Records that the interrupted process logged after its checkpoint are dropped from metrics.jsonl: the
resumed run writes those steps again, so every step has exactly one record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.checkpoint.save import (
    CHECKPOINTS_DIR,
    COMMIT_MARKER,
    committed_checkpoints,
    is_committed,
    latest_checkpoint,
)
from posttrain.checkpoint.state import read_trainer_state
from posttrain.distributed.env import broadcast_object, is_main
from posttrain.errors import CheckpointError, ConfigError
from posttrain.metrics import METRICS_FILE
from posttrain.run_dir import CONFIG_FILE, make_run_dir

logger = logging.getLogger("posttrain.trainers")

AUTO = "auto"


@dataclass(frozen=True)
class RunStart:
    run_dir: Path
    checkpoint: Path | None  # the checkpoint to restore before the first step; None: start at step 0


def open_run(command: str, cfg: Any) -> RunStart:
    """Create or reopen the run directory for a config with `out` and `resume` fields, and find the
    checkpoint to resume from. `config.yaml` is written without `resume`: it describes the run, not how
    this process was started, so resuming with an unchanged config keeps it as it is.

    Under torchrun rank 0 decides (and writes) and the other ranks receive its answer, so every rank uses
    the same directory (a default one is named after rank 0's clock) and the same checkpoint."""
    return broadcast_object(_open_run(command, cfg) if is_main() else None)


def _open_run(command: str, cfg: Any) -> RunStart:
    saved = dataclasses.replace(cfg, resume=None)
    if cfg.resume is None:
        return RunStart(make_run_dir(command, cfg.out, saved), None)
    checkpoint, run_dir = _resolve(cfg.resume, cfg.out)
    holds_run = (run_dir / CONFIG_FILE).is_file()
    run_dir = make_run_dir(command, run_dir, saved, resume=holds_run)
    if checkpoint is None:
        logger.info("resume=auto: no committed checkpoint in %s; starting at step 0", run_dir)
    else:
        logger.info("resuming from %s", checkpoint)
        _warn_about_later_checkpoints(run_dir, int(read_trainer_state(checkpoint)["step"]))
    if holds_run:
        truncate_metrics(run_dir, int(read_trainer_state(checkpoint)["step"]) if checkpoint is not None else -1)
    return RunStart(run_dir, checkpoint)


def _resolve(resume: str, out: str | None) -> tuple[Path | None, Path]:
    """(checkpoint or None, run directory)."""
    if resume == AUTO:
        if out is None:
            raise ConfigError("resume=auto needs out= (the run directory to continue)")
        run_dir = Path(out)
        found = latest_checkpoint(run_dir) if (run_dir / CONFIG_FILE).is_file() else None
        return (found[1] if found else None), run_dir
    checkpoint = Path(resume).expanduser()
    if not checkpoint.is_dir():
        raise CheckpointError(f"resume: {checkpoint} is not a directory (pass auto or a checkpoint directory)")
    if not is_committed(checkpoint):
        raise CheckpointError(
            f"resume: {checkpoint} has no {COMMIT_MARKER} marker: its write was interrupted, "
            "or it is not a checkpoint of a run"
        )
    if out is not None:
        return checkpoint, Path(out)
    if checkpoint.parent.name != CHECKPOINTS_DIR:
        raise ConfigError(
            f"resume: {checkpoint} is not inside a run's {CHECKPOINTS_DIR}/; pass out= for the run "
            "directory to write into"
        )
    return checkpoint, checkpoint.parent.parent


def _warn_about_later_checkpoints(run_dir: Path, step: int) -> None:
    """Resuming from an older checkpoint abandons the later ones: each is replaced when the run reaches its
    step again, but until then `resume=auto` would pick the newest of them."""
    later = [path.name for s, path in committed_checkpoints(run_dir) if s > step]
    if later:
        logger.warning(
            "%s holds later checkpoints (%s) of the run being continued from step %d; they are "
            "replaced as the run reaches them (resume=auto would pick them meanwhile)",
            run_dir / CHECKPOINTS_DIR,
            ", ".join(later),
            step,
        )


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep the records of steps <= `last_step` (none with -1); also drops a line cut short by a kill."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)

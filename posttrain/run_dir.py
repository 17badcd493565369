"""The output directory of one run: `config.yaml`, `metrics.jsonl`, checkpoints, `final/`.

A run dir holding a `config.yaml` belongs to a run. Writing a second run into it would mix two
runs' metrics and checkpoints, so that is refused unless the caller says it is resuming.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from posttrain.config import config_to_dict, save_config
from posttrain.errors import PosttrainError
from posttrain.writable import check_writable_dir, os_error_line

CONFIG_FILE = "config.yaml"
DEFAULT_RUNS_ROOT = Path("runs")
_COMMAND_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def make_run_dir(
    command: str,
    out: str | Path | None,
    config: Any,
    resume: bool = False,
    runs_root: str | Path = DEFAULT_RUNS_ROOT,
) -> Path:
    """Create (or, with `resume`, reopen) the run directory and write `config.yaml` into it.

    `out=None` makes `<runs_root>/<command>-<YYYYmmdd-HHMMSS>` (a `-2`, `-3`, ... suffix keeps two
    runs started in the same second apart). When resuming, a changed config replaces `config.yaml`
    and the previous one is kept as `config.before-resume-<stamp>.yaml`.
    """
    if not _COMMAND_NAME.match(command):
        raise ValueError(f"command name {command!r} cannot name a directory")
    if out is None:
        if resume:
            raise PosttrainError("resuming needs the run directory to resume: pass --out")
        run_dir = _new_timestamped_dir(Path(runs_root), command)
    else:
        run_dir = Path(out)
        _check_out_dir(run_dir, resume)
        check_writable_dir(run_dir)  # names what is in the way (a regular file, a read-only parent)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # read-only, not permitted, a regular file on the way
            raise PosttrainError(os_error_line(run_dir, exc, "cannot create the run directory")) from None
    try:
        if resume:
            _keep_previous_config(run_dir, config)
        save_config(config, run_dir / CONFIG_FILE)
    except OSError as exc:
        raise PosttrainError(os_error_line(run_dir, exc, "cannot write the run directory")) from None
    return run_dir


def check_run_dir_writable(
    out: str | Path | None, resume: str | None = None, runs_root: str | Path = DEFAULT_RUNS_ROOT
) -> None:
    """Fail now, before any compute, if the run directory `make_run_dir` will write cannot be written: `out`, or
    with `out=None` a timestamped one under `runs_root`. Leaves nothing behind. Resuming a checkpoint without
    `out` reopens the checkpoint's own run, which `make_run_dir` checks when it gets there."""
    if out is None and resume is not None:
        return
    check_writable_dir(runs_root if out is None else out)


def final_dir(run_dir: str | Path) -> Path:
    """Where the run's final model goes (`<run>/final`); the saver creates it."""
    return Path(run_dir) / "final"


def _new_timestamped_dir(runs_root: Path, command: str) -> Path:
    check_writable_dir(runs_root)
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PosttrainError(os_error_line(runs_root, exc, "cannot create the runs directory")) from None
    stem = f"{command}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    # mkdir without exist_ok is atomic: of two processes racing for a name, one gets it.
    for attempt in range(1, 10_000):
        candidate = runs_root / (stem if attempt == 1 else f"{stem}-{attempt}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise PosttrainError(os_error_line(candidate, exc, "cannot create the run directory")) from None
    raise PosttrainError(f"{runs_root}: cannot find a free run directory name for {stem}")


def _check_out_dir(run_dir: Path, resume: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise PosttrainError(f"{run_dir}: output path exists and is not a directory")
    holds_run = (run_dir / CONFIG_FILE).is_file()
    if resume and not holds_run:
        raise PosttrainError(f"{run_dir}: nothing to resume (no {CONFIG_FILE} of an earlier run there)")
    if holds_run and not resume:
        raise PosttrainError(
            f"{run_dir}: already holds another run ({CONFIG_FILE} exists); choose another --out or resume that run"
        )
    # A non-empty directory without a config.yaml (say, a scheduler's log) is not a run: fine.


def _keep_previous_config(run_dir: Path, config: Any) -> None:
    previous = run_dir / CONFIG_FILE
    try:
        unchanged = yaml.safe_load(previous.read_text(encoding="utf-8")) == config_to_dict(config)
    except yaml.YAMLError:
        unchanged = False  # unreadable: keep it aside all the same
    if not unchanged:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        previous.rename(_free_name(run_dir, f"config.before-resume-{stamp}", ".yaml"))


def _free_name(directory: Path, stem: str, suffix: str) -> Path:
    candidate = directory / f"{stem}{suffix}"
    n = 2
    while candidate.exists():
        candidate = directory / f"{stem}-{n}{suffix}"
        n += 1
    return candidate

"""What every experiment tracker adapter is: one interface, and the values the trackers can hold.

An adapter wraps one library (TensorBoard, Weights & Biases, Trackio, MLflow) behind three calls:

    tracker = TRACKERS["wandb"](project="posttrain")
    tracker.open(run_name, config, run_dir)   # start the library's run: the name, the resolved config
    tracker.log(metrics, step)                # one metrics.jsonl record (without step and time)
    tracker.close()                           # finish the library's run

The library is imported in `open`, never at import time, so a tracker nobody asked for costs nothing
and a missing one is found by `registry.check_installed` before a run starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

from posttrain.errors import PosttrainError

Metrics = Mapping[str, Any]  # metric name -> float | int | bool | str | None; non-finite floats as floats


class Tracker(Protocol):
    """One experiment tracker. `name` is the `log.report_to` entry, `package` the module to import and
    `extra` the posttrain extra that installs it (`registry.register` gives an adapter its name for those it
    leaves out)."""

    name: ClassVar[str]
    package: ClassVar[str]
    extra: ClassVar[str]

    def __init__(self, project: str) -> None: ...

    def open(self, run_name: str, config: Mapping[str, Any], run_dir: Path) -> None: ...

    def log(self, metrics: Metrics, step: int) -> None: ...

    def close(self) -> None: ...


def not_installed(name: str, package: str, extra: str, asked_by: str | None = None) -> str:
    """The one line a missing tracker library gets; `asked_by` is the setting that asked for it."""
    asked_by = asked_by or f"log.report_to includes '{name}'"
    return f"{asked_by} but the {package} package is not installed: pip install 'posttrain[{extra}]'"


def import_library(tracker: Tracker, module: str) -> Any:
    """`importlib.import_module(module)`, a module of `tracker`'s library, or the one-line PosttrainError naming
    the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PosttrainError(not_installed(tracker.name, tracker.package, tracker.extra)) from None


def numbers(metrics: Metrics) -> Iterator[tuple[str, float]]:
    """The metrics a scalar store can hold: ints and floats (nan and inf included) as floats. Strings,
    booleans and nulls stay in metrics.jsonl only."""
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> text (`optim.lr` -> `1e-05`): for stores whose parameters are flat
    strings. Strings stay as they are; every other value is written as JSON (`true`, `null`, `[1, 2]`)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, dotted))
        elif isinstance(value, str):
            out[dotted] = value
        else:
            out[dotted] = json.dumps(value, default=str, allow_nan=True)
    return out

"""`log.report_to`: which trackers a run's metrics also go to, chosen by name from `TRACKERS`.

names = resolve_report_to(["wandb", "mlflow"])         # also "wandb", "none", None, [] (-> [])
check_installed(names)                                 # before any compute: one line naming the extra
trackers = open_trackers(names, "posttrain", run_name, config, run_dir)
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from posttrain.errors import ConfigError, PosttrainError
from posttrain.trackers.base import Tracker, not_installed

NONE = "none"
TRACKERS: dict[str, type[Tracker]] = {}  # report_to name -> adapter class, filled by `register`

T = TypeVar("T")


def register(cls: type[T]) -> type[T]:
    """Class decorator: make an adapter choosable as `log.report_to: [<cls.name>]`. `package` (the module
    `check_installed` looks for) and `extra` (the posttrain extra that installs it) default to the adapter's name
    when the class leaves them out."""
    name = cls.name  # type: ignore[attr-defined]
    if name in TRACKERS or name == NONE:
        raise ValueError(f"tracker name {name!r} is taken")
    for attribute in ("package", "extra"):
        if not hasattr(cls, attribute):
            setattr(cls, attribute, name)
    TRACKERS[name] = cls  # type: ignore[assignment]
    return cls


def resolve_report_to(report_to: Sequence[str] | str | None, tensorboard: bool = False) -> list[str]:
    """The tracker names to use, in order, each once. A single name stands for a list of one; "none", null
    and [] for no tracker. `tensorboard=True` (the older `log.tensorboard` switch) adds TensorBoard.
    Raises ValueError for a name that is not a tracker."""
    if report_to is None or report_to == NONE:
        names: list[str] = []
    elif isinstance(report_to, str):
        names = [report_to]
    else:
        names = list(report_to)
        if NONE in names and len(names) > 1:
            raise ValueError(f"report_to: 'none' cannot be combined with other trackers, got {names}")
        names = [n for n in names if n != NONE]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r} (one of: {', '.join(TRACKERS)}, or none)")
    if tensorboard:
        names.append("tensorboard")
    return list(dict.fromkeys(names))


def check_installed(names: Sequence[str], asked_by: str | None = None) -> None:
    """Raise ConfigError (the one line `not_installed` writes, complete as it is) for the first tracker whose
    library is missing. Looks the package up without importing it: cheap enough for every config load."""
    for name in names:
        cls = TRACKERS[name]
        if not _importable(cls.package):
            raise ConfigError(not_installed(name, cls.package, cls.extra, asked_by))


def open_trackers(
    names: Sequence[str], project: str, run_name: str, config: Mapping[str, Any], run_dir: Path
) -> list[Tracker]:
    """Open each named tracker; if one cannot start, close the ones already open and raise PosttrainError."""
    opened: list[Tracker] = []
    try:
        for name in names:
            tracker = TRACKERS[name](project)
            try:
                tracker.open(run_name, config, run_dir)
            except PosttrainError:
                raise
            except Exception as e:  # the library's own error (no login, bad URI): one line, not its traceback
                first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise PosttrainError(f"log.report_to: {name} could not start a run: {first_line}") from e
            opened.append(tracker)
    except BaseException:
        for tracker in opened:  # the open failure is the error to report; a close failing now would hide it
            try:
                tracker.close()
            except Exception:  # noqa: BLE001
                pass
        raise
    return opened


def close_all(trackers: Sequence[Tracker]) -> None:
    """Close every tracker, even when one of them fails; the first failure is raised after the rest closed."""
    failure: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as e:  # noqa: PERF203 - each tracker must get its close
            failure = failure or e
    if failure is not None:
        raise failure


def _importable(module: str) -> bool:
    if module in sys.modules:  # None there means "import fails" (how tests stand in for an uninstalled package)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False

"""Whether an output directory can be written, found out before any compute.

Commands write their output after minutes or hours of work (a trained model, a quantized checkpoint), so a
path that cannot be written is checked up front: `check_writable_dir` creates what is missing, writes a file
there and removes all of it again. Actually trying is the only reliable test: permission bits say nothing
for root, and sysfs, read-only mounts or a regular file in the way refuse only when asked.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from posttrain.errors import PosttrainError

_PROBE_PREFIX = ".posttrain-write-check-"


def check_writable_dir(
    path: str | Path, subject: str | Path | None = None, doing: str = "cannot write the output directory"
) -> None:
    """Raise a PosttrainError (one line: `subject`, default `path`, then `doing` and the reason) unless a
    directory can be created at `path`, with its missing parents, and written into; leaves nothing behind."""
    path = Path(path)
    subject = Path(subject) if subject is not None else path
    missing = []  # deepest first
    existing = path
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == subject else f"{existing} "
        raise PosttrainError(f"{subject}: {doing}: {where}exists and is not a directory")
    created: list[Path] = []
    try:
        for directory in reversed(missing):
            directory.mkdir()
            created.append(directory)
        fd, probe = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PosttrainError(os_error_line(subject, exc, doing)) from None
    finally:
        for directory in reversed(created):
            try:
                directory.rmdir()
            except OSError:
                pass  # another process wrote into it meanwhile: it is theirs now


def check_writable_file(path: str | Path) -> None:
    """Raise a PosttrainError naming `path` unless a file can be written there (its directory is created when
    it comes to writing; nothing is left behind now)."""
    path = Path(path)
    if path.is_dir():
        raise PosttrainError(f"{path}: cannot write the file: it is a directory")
    check_writable_dir(path.parent, subject=path, doing="cannot write the file")


def os_error_line(subject: str | Path, exc: OSError, doing: str) -> str:
    """`<subject>: <doing>: [<the path that failed>: ]<the OS's reason>`, the path only where it is not `subject`
    (a parent directory, or the directory a probe file was to go into)."""
    reason = exc.strerror or type(exc).__name__
    if exc.filename is None:
        return f"{subject}: {doing}: {reason}"
    failed = Path(os.fsdecode(exc.filename))
    if failed.name.startswith(_PROBE_PREFIX):
        failed = failed.parent
    if failed == Path(subject):
        return f"{subject}: {doing}: {reason}"
    return f"{subject}: {doing}: {failed}: {reason}"

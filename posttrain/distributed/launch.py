"""`posttrain <trainer> --nproc N ...`: the same command under torchrun, N processes on this machine.

It re-runs the command line, without `--nproc`, as `python -m torch.distributed.run --standalone
--nproc-per-node N -m posttrain ...` (a rendezvous on a free local port), and returns torchrun's exit code.
For several machines use torchrun itself (docs/distributed.md).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from posttrain.distributed.env import launched_by_torchrun
from posttrain.errors import ConfigError


def without_nproc(argv: Sequence[str]) -> list[str]:
    """`argv` less its `--nproc N` / `--nproc=N`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def split_nproc(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """(the value of `--nproc N` / `--nproc=N` anywhere in `argv`, or None; `argv` without it). A trainer's
    overrides swallow everything after the config path, so `--nproc` is looked for there too."""
    value: str | None = None
    for index, arg in enumerate(argv):
        if arg == "--nproc" and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith("--nproc="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None, list(argv)
    try:
        return int(value), without_nproc(argv)
    except ValueError:
        raise ConfigError(f"--nproc needs a number of processes, got {value!r}") from None


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "posttrain",
        *without_nproc(argv),
    ]


def relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Run `posttrain <argv>` in `nproc` torchrun processes; their exit code (0 when every rank succeeded)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if launched_by_torchrun():
        raise ConfigError("--nproc inside a torchrun launch: torchrun already started the processes; drop --nproc")
    return subprocess.call(torchrun_command(nproc, argv))

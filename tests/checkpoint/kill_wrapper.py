"""Run `posttrain <command> ...` in this process and SIGKILL it at a chosen point, for the resume tests.

    python kill_wrapper.py update N -- sft ...   killed inside the N-th optimizer update (mid-step)
    python kill_wrapper.py commit N -- sft ...   killed while checkpoint step-N is written: after its files
                                                 are renamed into place, before the COMMITTED marker
    python kill_wrapper.py none 0 -- sft ...     not killed

A real SIGKILL (no cleanup, no finally blocks) at a point the test chooses, instead of racing a timer
against a tiny model that finishes in a second.
"""

from __future__ import annotations

import os
import signal
import sys

import torch


def _kill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    mode, count, separator, *argv = sys.argv[1:]
    assert separator == "--", "usage: kill_wrapper.py MODE N -- COMMAND ARGS..."
    count = int(count)
    torch.set_num_threads(1)  # the same in every run of a comparison, so reductions sum in the same order
    if mode == "update":
        import posttrain.trainers.optim as optim

        original, calls = optim.clip_gradients, [0]

        def clip_then_maybe_die(*args, **kwargs):
            calls[0] += 1
            if calls[0] == count:
                _kill()
            return original(*args, **kwargs)

        optim.clip_gradients = clip_then_maybe_die
    elif mode == "commit":
        import posttrain.checkpoint.state as train_state

        original_commit = train_state.commit

        def die_before_marker(path, text=""):
            if path.name == f"step-{count}":
                _kill()
            return original_commit(path, text)

        train_state.commit = die_before_marker
    from posttrain.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())

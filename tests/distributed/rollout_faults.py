"""`python -m tests.distributed.rollout_faults die|hang STEP <posttrain arguments>`: the posttrain CLI whose rollout
ranks (dist.rollout_ranks) fail when they start collecting step STEP: `die` exits the process at once (as a
killed or crashed worker would), `hang` sleeps for an hour (a stuck one). The trainer must notice and stop."""

from __future__ import annotations

import os
import sys
import time

from posttrain.trainers.rl import rollout_procs


def inject(fault: str, at_step: int) -> None:
    collect = rollout_procs._collect

    def failing(cfg, side, ctx, step):
        if step == at_step:
            if fault == "die":
                os._exit(3)
            time.sleep(3600)
        return collect(cfg, side, ctx, step)

    rollout_procs._collect = failing


if __name__ == "__main__":
    from posttrain.cli import program

    inject(sys.argv[1], int(sys.argv[2]))
    program(sys.argv[3:])  # exits: a torchrun rank without the runtime's teardown (posttrain.cli.program)

"""What a trainer does differently under torchrun: join the process group, place the model on the rank's
device, log from rank 0 only, write the final model from whole weights on rank 0.

    ctx, model_section = join_processes(cfg.dist, cfg.model)   before loading the model
    parallel = Parallel(model, cfg.dist, ctx)                  before building the optimizer
    with main_metrics(run_dir, cfg) as metrics: ...            a MetricsLogger on rank 0 (with cfg.log's trackers)
    write_from_main(parallel, write)                           write(whole model) on rank 0, the others wait

The trainers' `save_final_parallel` (posttrain.trainers.adapters) is `write_from_main` with the final save.
This module sees the model section only through the two fields it reads, so it imports no trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from posttrain.config import config_to_dict
from posttrain.cpu_malloc import set_malloc_policy
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import DistContext, barrier, init_distributed, is_main
from posttrain.distributed.parallel import Parallel
from posttrain.errors import ConfigError
from posttrain.metrics import MetricsLogger


class ModelPlacement(Protocol):
    """The fields of a trainer's `model:` section (a dataclass) that say where the model runs."""

    device: str | None
    cpu_memory: Literal["keep", "release"]


PlacementT = TypeVar("PlacementT", bound=ModelPlacement)


def join_processes(dist: DistSection, model: PlacementT) -> tuple[DistContext, PlacementT]:
    """Join torchrun's process group (nothing with strategy none) and put the model on this rank's device:
    cuda:LOCAL_RANK when CUDA is used, the CPU otherwise (with the malloc policy of `model.cpu_memory`)."""
    device = model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device_type = torch.device(device).type
    if device_type == "cpu" and model.cpu_memory == "release":
        set_malloc_policy("release")  # before the weights load: their freed staging goes back too
    if dist.rollout_ranks:  # the trainer beside rollout processes: one process of its own (distributed.rollout_link)
        ctx = DistContext()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            model = dataclasses.replace(model, device=f"cuda:{local}")
        return ctx, model
    ctx = init_distributed(dist.strategy, device_type)
    if dist.strategy != "none" and device_type == "cuda":
        model = dataclasses.replace(model, device=f"cuda:{ctx.local_rank}")
    return ctx, model


def open_metrics(run_dir: Path, cfg: Any) -> MetricsLogger:
    """The run's MetricsLogger: metrics.jsonl and the trackers of `cfg.log`, which get the run's name and its
    config as config.yaml holds it (without `resume`, which says how this process started, not the run)."""
    log = cfg.log
    config = config_to_dict(dataclasses.replace(cfg, resume=None))
    return MetricsLogger(run_dir, report_to=log.trackers(), config=config, project=log.project)


@contextlib.contextmanager
def main_metrics(run_dir: Path, cfg: Any) -> Iterator[MetricsLogger | None]:
    """`open_metrics` on rank 0 (the metrics it logs are already reduced over the ranks), None elsewhere."""
    if not is_main():
        yield None
        return
    with open_metrics(run_dir, cfg) as metrics:
        yield metrics


def write_from_main(parallel: Parallel, write: Callable[[nn.Module], object]) -> None:
    """`write(model)` with the whole weights on rank 0; every rank returns once it is written."""
    model = parallel.whole(parallel.model)  # fsdp2: gathered into a CPU copy of the same structure on rank 0
    if is_main():
        if model is None:
            raise ConfigError("rank 0 received no weights to export")
        write(model)
    barrier()

"""What a trainer does differently under torchrun: join the process group, place the model on the rank's
device, write files from rank 0 only, save the final model from whole weights.

    ctx, model_section = join_processes(cfg.dist, cfg.model)   before loading the model
    parallel = Parallel(model, cfg.dist, ctx)                  before building the optimizer
    with main_metrics(run_dir, cfg) as metrics: ...            a MetricsLogger on rank 0 (with cfg.log's trackers)
    save_final_parallel(parallel, tokenizer, run_dir, base)    final/ (one HF directory, from rank 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from posttrain.config import config_to_dict
from posttrain.cpu_malloc import set_malloc_policy
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import DistContext, barrier, init_distributed, is_main
from posttrain.distributed.parallel import Parallel
from posttrain.errors import ConfigError
from posttrain.metrics import MetricsLogger
from posttrain.run_dir import final_dir
from posttrain.trainers.adapters import save_final_dir
from posttrain.trainers.sections import ModelSection


def join_processes(dist: DistSection, model: ModelSection) -> tuple[DistContext, ModelSection]:
    """Join torchrun's process group (nothing with strategy none) and put the model on this rank's device:
    cuda:LOCAL_RANK when CUDA is used, the CPU otherwise (with the malloc policy of `model.cpu_memory`)."""
    device = model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device_type = torch.device(device).type
    if device_type == "cpu" and model.cpu_memory == "release":
        set_malloc_policy("release")  # before the weights load: their freed staging goes back too
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


def save_final_parallel(parallel: Parallel, tokenizer: Any, run_dir: Path, *, base_model: str) -> Path:
    """<run>/final from the whole weights, written by rank 0 (the others wait for it): the HF directory, the PEFT
    adapter (LoRA, QLoRA) or the quantized export (QAT), as a single process writes it."""
    model = parallel.whole(parallel.model)  # fsdp2: gathered into a CPU copy of the same structure on rank 0
    if is_main():
        if model is None:
            raise ConfigError("rank 0 received no weights to export")
        save_final_dir(model, tokenizer, run_dir, base_model=base_model)
    barrier()
    return final_dir(run_dir)

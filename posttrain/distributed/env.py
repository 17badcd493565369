"""The process group from the torchrun environment, and the few collectives the trainers use.

torchrun (`python -m torch.distributed.run`) starts one process per device and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in each; `init_distributed` reads them. Without them the run is a
single process and every helper here is a no-op, so trainers call them unconditionally.
"""

from __future__ import annotations

import faulthandler
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from posttrain.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def init_distributed(strategy: str, device_type: str) -> DistContext:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); a single-process context for
    strategy none. Idempotent: a second call (a second trainer in one process) reuses the group."""
    if strategy == "none":
        if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"dist.strategy=none, but torchrun started {os.environ['WORLD_SIZE']} processes: "
                "set dist.strategy=ddp or dist.strategy=fsdp2"
            )
        return DistContext()
    if not launched_by_torchrun():
        missing = [name for name in TORCHRUN_VARS if name not in os.environ]
        raise ConfigError(
            f"dist.strategy={strategy} needs the torchrun environment ({', '.join(missing)} not set): "
            "launch with `torchrun --nproc-per-node N -m posttrain <command> ...` or add `--nproc N`"
        )
    ctx = DistContext(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    # A rank killed by a signal (SIGSEGV, SIGABRT) prints its Python stacks: torchrun reports only the signal.
    faulthandler.enable()
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group(backend=backend)
    return ctx


def is_main() -> bool:
    """True on rank 0, and in a single process: the one process that writes files and logs."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a run directory path, a resume decision)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_metrics(
    metrics: dict[str, Any],
    sum_keys: set[str] | frozenset[str],
    device: torch.device,
    absent_is_zero: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Metrics of the whole step from each rank's share: keys in `sum_keys` summed over the ranks (token
    counts, each rank's part of a globally-normalised loss), every other numeric key averaged over the ranks
    that have it (values that are the same on every rank, such as the gradient norm after the reduction, stay
    what they are). A key only some ranks report (a metric of a case one rank met) is reduced over those, unless
    it starts with one of `absent_is_zero`: a rate a rank leaves out when it is 0 there (the share of episodes
    that ended one way), averaged over every rank. Text values stay this rank's. Two collectives: the key lists,
    then one all-reduce."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(metrics)
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, sorted(numeric))
    keys = sorted(set().union(*lists))
    if not keys:
        return dict(metrics)
    # (2, K): row 0 the values (0 where this rank has none), row 1 how many ranks contributed.
    table = torch.tensor(
        [[numeric.get(k, 0.0) for k in keys], [float(k in numeric) for k in keys]], dtype=torch.float64, device=device
    )
    dist.all_reduce(table)
    totals, counts = table.tolist()
    world = float(dist.get_world_size())
    counts = [world if k.startswith(absent_is_zero) else c for k, c in zip(keys, counts)]
    reduced = {k: total if k in sum_keys else total / count for k, total, count in zip(keys, totals, counts)}
    return {**metrics, **reduced}


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of `tensor` over the ranks, as a new tensor (a copy in a single process)."""
    out = tensor.clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; [obj] in a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order: (W * n, ...) from each rank's (n, ...)
    (the same shape on every rank, as `Parallel.check_divides` ensures for a batch); `tensor` itself in a
    single process. Not differentiable: for batch statistics such as KTO's KL reference point."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    return torch.cat(parts)


def all_reduce_count(count: float, device: torch.device) -> float:
    """The sum of `count` over the ranks (the global token or pair count a loss is normalised by)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    value = torch.tensor([float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(value)
    return float(value.item())

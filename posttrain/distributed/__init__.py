"""Data parallelism on torch.distributed (torchrun): DDP or FSDP2, sharded checkpoints, `--nproc`.

See docs/distributed.md. Trainers use `Parallel` (the wrapped model), the collectives of `env`, what a
rank does under torchrun through `processes` (join, rank-0 metrics and final writes), and `checkpoint`
through `posttrain.checkpoint.state`. Nothing here imports a trainer.
"""

from posttrain.distributed.config import DistSection
from posttrain.distributed.env import DistContext, all_reduce_count, barrier, init_distributed, is_main, reduce_metrics
from posttrain.distributed.parallel import Parallel

__all__ = [
    "DistContext",
    "DistSection",
    "Parallel",
    "all_reduce_count",
    "barrier",
    "init_distributed",
    "is_main",
    "reduce_metrics",
]

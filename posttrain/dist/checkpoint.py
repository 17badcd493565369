"""Sharded model + optimizer state with torch.distributed.checkpoint (DCP).

Each rank writes only its own shards (`__<rank>_0.distcp` files plus one `.metadata`), keyed by parameter
name and global offsets; loading reads the pieces each rank needs for *its* layout, so a checkpoint written
by 2 FSDP2 ranks loads into 1 process (sharded or not), into 4, or into a DDP run. Collective on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

METADATA_FILE = ".metadata"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Write `model`'s parameters and `optimizer`'s state (by parameter name) as DCP shards into `path`."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Load what `save_sharded` wrote into the live model and optimizer (same Parameters, resharded to this
    run's layout)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])

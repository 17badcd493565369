"""Sharded model + optimizer state with torch.distributed.checkpoint (DCP).

Each rank writes only its own shards (`__<rank>_0.distcp` files plus one `.metadata`), keyed by parameter
name and global offsets; loading reads the pieces each rank needs for *its* layout, so a checkpoint written
by 2 FSDP2 ranks loads into 1 process (sharded or not), into 4, or into a DDP run. Collective on every rank.

Modules trained beside the model (a score or value head; the optimizer holds their parameters too) go into
the same shards: model and heads are then named as one container, `model.<name>` and `beside.<head>.<name>`,
in every layout, so the checkpoint of an FSDP2 reward model loads into a single process as well.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

# torch.distributed.checkpoint is imported where it is used: with DTensor's ops it takes ~1.5 s to import, which
# every command and every torchrun rank would otherwise pay at startup, sharded checkpoint or not.

METADATA_FILE = ".metadata"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


class _Beside(nn.Module):
    """The model and the modules trained beside it under one set of names (the names of FSDP2's root)."""

    def __init__(self, model: nn.Module, beside: dict[str, nn.Module]) -> None:
        super().__init__()
        self.model = model
        self.beside = nn.ModuleDict(beside)


def _named(model: nn.Module, beside: dict[str, nn.Module] | None) -> nn.Module:
    """What the checkpoint names its tensors after: the model itself, or model and heads together."""
    return _Beside(model, beside) if beside else model


def save_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, beside: dict[str, nn.Module] | None = None
) -> None:
    """Write `model`'s (and the `beside` modules') parameters and `optimizer`'s state (by parameter name) as DCP
    shards into `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    named = _named(model, beside)
    state = {"model": get_model_state_dict(named), "optim": get_optimizer_state_dict(named, optimizer)}
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, beside: dict[str, nn.Module] | None = None
) -> None:
    """Load what `save_sharded` wrote into the live model, `beside` modules and optimizer (same Parameters,
    resharded to this run's layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    named = _named(model, beside)
    state = {"model": get_model_state_dict(named), "optim": get_optimizer_state_dict(named, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(named, state["model"])
    set_optimizer_state_dict(named, optimizer, state["optim"])

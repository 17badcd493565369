"""Whole modules out of FSDP2 shards: for the final directory (HF weights, a PEFT adapter, a QAT export, a head).

A sharded module can only be gathered tensor by tensor; writing it needs a module of the same *structure*
(LoRA layers, fake-quantized or quantized linears, a score head) holding the whole tensors. So before
sharding, `meta_skeleton` copies the structure with every tensor on the meta device (no memory), and
`whole_copy` fills a copy of that skeleton with the gathered tensors. Every rank takes part in the gather
(an all-gather per parameter); only rank 0 keeps the result, on CPU, so the full weights never sit on a
device next to the shards.
"""

from __future__ import annotations

import copy
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole (unsharded) CPU tensors of `model` on rank 0; an empty dict on the other ranks. Collective."""
    # Imported here, as in posttrain/distributed/checkpoint.py (~1.5 s of import at every startup otherwise).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers are meta tensors of the same shapes and dtypes
    (tied parameters stay tied, requires_grad is kept). Take it before `fully_shard` changes the module."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(module, memo)


def _shared_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that name one tensor (a tied LM head and embedding), each of 2 or more."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def whole_copy(module: nn.Module, skeleton: nn.Module) -> nn.Module | None:
    """`skeleton` (from `meta_skeleton(module)` before sharding) holding `module`'s whole weights on rank 0
    (CPU), None on the other ranks. Collective: every rank must call it."""
    state = full_state_dict(module)
    if dist.get_rank() != 0:
        return None
    out = copy.deepcopy(skeleton)  # meta tensors: a copy costs nothing, and the skeleton serves again
    tied = _shared_names(out)
    out.load_state_dict(state, strict=True, assign=True)
    for names in tied:  # assign=True gives each name its own tensor: tie them again
        first = out.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(out.get_submodule(owner) if owner else out, leaf, first)
    return out.eval()

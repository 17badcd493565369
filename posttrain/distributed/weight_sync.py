"""Weight broadcast from the trainer to rollout processes that generate on their own copy of the model.

In one process the engine runs the trainer's very parameters; a rollout *process* holds a copy, which the
trainer refreshes after its update: `WeightBroadcast.send` on the trainer, `receive` on every rollout rank,
over a process group of those ranks (gloo on CPU, NCCL on CUDA: the code is the same). The receiver copies
into its parameters in place (the engine holds them) and the caller then calls its engine's
`weights_updated()` up to the trainer's policy version, sent with the weights.

What goes over the wire: the parameters the optimizer updates (`synced_parameters(model, "trainable")`):
after `apply_lora` those are the adapter tensors only, since a frozen base never changes and both sides load
it from the same files; `"all"` sends every parameter (each tied tensor once). The tensors are flattened
into few buckets (one per dtype and device, split at `bucket_mb`), one broadcast per bucket, not one per tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

SYNC_WHICH = ("trainable", "all")
DEFAULT_BUCKET_MB = 64.0
STOP = -1  # the version `send_stop` sends: no weights follow, the receivers stop


def synced_parameters(model: nn.Module, which: Literal["trainable", "all"] = "trainable") -> list[nn.Parameter]:
    """The parameters a sync sends, each tensor once, in the module's order (the same on every rank of one
    model structure): those that require gradients (the LoRA adapters when they are on), or all of them."""
    seen: set[int] = set()
    out = []
    for param in model.parameters():  # remove_duplicate: a tied LM head is the embedding, sent once
        if id(param) in seen or (which == "trainable" and not param.requires_grad):
            continue
        seen.add(id(param))
        out.append(param)
    return out


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    version: int

    def metrics(self) -> dict[str, float]:
        return {"async/weight_sync_s": self.seconds, "async/weight_sync_mb": self.bytes / 2**20}


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` grouped by (dtype, device), in order, each group split where it passes `bucket_bytes`."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        size = tensor.numel() * tensor.element_size()
        if key not in groups or sizes[key] + size > bucket_bytes:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(tensor)
        sizes[key] += size
    return [bucket for buckets in groups.values() for bucket in buckets if bucket]


class WeightBroadcast:
    """The same tensors, on every rank of `group`, made equal to those of rank `src` (of the group) on each
    call: `send` there, `receive` on the others. Every rank must list the tensors in the same order with the
    same shapes and dtypes (`synced_parameters` of one model structure)."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        group: dist.ProcessGroup,
        src: int = 0,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        self.group = group
        self.src = src
        self.buckets = _buckets(tensors, max(1, int(bucket_mb * 2**20)))
        self.bytes = sum(t.numel() * t.element_size() for t in tensors)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.src
        self.group.broadcast([tensor], options).wait()

    def _version(self, version: int) -> int:
        """The trainer's policy version, from `src` to every rank (a one-element int64 tensor, on the device
        of the first bucket: NCCL sends device tensors only)."""
        device = self.buckets[0][0].device if self.buckets else torch.device("cpu")
        box = torch.tensor([version], dtype=torch.int64, device=device)
        self._broadcast(box)
        return int(box.item())

    @torch.no_grad()
    def send(self, version: int) -> SyncStats:
        """On `src`: broadcast the tensors and `version` (the policy version they are)."""
        start = time.perf_counter()
        self._version(version)
        for bucket in self.buckets:
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])  # (sum of numels,)
            self._broadcast(flat)
        return SyncStats(time.perf_counter() - start, self.bytes, version)

    def send_stop(self) -> None:
        """On `src`: tell the receivers that no more weights come (their `receive` returns version STOP)."""
        self._version(STOP)

    @torch.no_grad()
    def receive(self) -> SyncStats:
        """On the other ranks: overwrite the tensors in place with `src`'s; returns the version they are (STOP,
        with nothing received, after `send_stop`)."""
        start = time.perf_counter()
        version = self._version(STOP)
        if version == STOP:
            return SyncStats(time.perf_counter() - start, 0, STOP)
        for bucket in self.buckets:
            flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            self._broadcast(flat)
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        return SyncStats(time.perf_counter() - start, self.bytes, version)

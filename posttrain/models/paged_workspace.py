"""What the paged attention carries from one call to the next, owned by whoever runs the steps (the engine's
model runner) and handed to every layer through `PagedAttentionMetadata.workspace`.

- the step's plan: built at layer 0 from the metadata, reused by the other layers (paged_plan.plan_for);
- the decoding sequences' staged suffix K/V, carried from step to step (decode_staging.SuffixStaging);
- scratch buffers for the PyTorch path's gathers, reused across layers and steps.

One workspace per engine, so two engines in one thread (a trainer's and an evaluator's) never share staged
K/V, and nothing lives in module or thread state. A metadata built without one (tests, one-off calls) gets a
fresh workspace: correct, only without reuse across calls.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.models.decode_staging import SuffixStaging


class PagedWorkspace:
    def __init__(self) -> None:
        self.staging = SuffixStaging()
        self.plan: tuple[Any, bool, Any] | None = None  # (a weak reference to its metadata, native, the Plan)
        self._buffers: dict[str, torch.Tensor] = {}

    def release(self) -> None:
        """Free the staged K/V and the scratch buffers (the engine calls it when no request is left)."""
        self.staging.release()
        self.plan = None
        self._buffers.clear()

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A reused scratch tensor of `like`'s dtype and device (grown when too small); valid until the next call
        with the same name."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(name)
        stale = buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device
        # A buffer made under inference_mode cannot be written outside it.
        if stale or (buf.is_inference() and not torch.is_inference_mode_enabled()):
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

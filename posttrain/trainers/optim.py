"""AdamW with the usual parameter groups, and the optimizer step with gradient clipping."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from posttrain.trainers.sections import OptimSection

logger = logging.getLogger("posttrain.trainers")

FUSED_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps")  # where torch's fused AdamW kernel exists


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (decayed) and vectors (norm weights and biases: not decayed).

    Frozen parameters are left out (so a LoRA model hands only its adapters to the optimizer), and a
    parameter shared by two modules (tied embeddings / LM head) appears once.
    """
    decay, no_decay = [], []
    for param in model.parameters():  # yields each shared parameter once
        if not param.requires_grad:
            continue
        # Norm weights and biases are the 1-D parameters; embeddings and projections are decayed.
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """torch AdamW over `param_groups`, fused when every parameter lives where the fused kernel does,
    else the multi-tensor (foreach) implementation."""
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    params = [p for g in groups for p in g["params"]]
    fused = all(p.device.type in FUSED_DEVICE_TYPES and p.is_floating_point() for p in params)
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **impl)


def optimizer_for(model: nn.Module, optim: OptimSection) -> torch.optim.AdamW:
    """`build_optimizer` with an `optim:` section's rate, weight decay, betas and eps."""
    return build_optimizer(model, optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps)


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Total gradient L2 norm before clipping; clips to `max_norm` unless it is None."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    limit = math.inf if max_norm is None else max_norm
    total = torch.nn.utils.get_total_norm([p.grad for p in grads], 2.0, foreach=True)
    if hasattr(total, "full_tensor"):
        # FSDP2: the gradients are DTensor shards, their norm a partial one; full_tensor() all-reduces it
        # into the norm of the whole gradient, the same on every rank, so every rank clips alike.
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(grads, limit, total, foreach=True)
    return float(total)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    max_grad_norm: float | None,
    loss: float | None = None,
) -> tuple[float, bool]:
    """Clip, step, advance the schedule, clear the gradients. Returns (grad_norm, applied).

    A non-finite `loss` (when given) or gradient norm (an overflow, a NaN) skips the update instead of
    writing NaN into every weight: weights and optimizer state stay as they were. The schedule still
    advances so the step count stays honest. `faults.BadStepGuard` counts the skips and ends a run
    that keeps producing them.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = clip_gradients(params, max_grad_norm)
    applied = math.isfinite(grad_norm) and (loss is None or math.isfinite(loss))
    if applied:
        optimizer.step()
    else:
        logger.debug("non-finite loss %s / gradient norm %s: update skipped", loss, grad_norm)
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, applied

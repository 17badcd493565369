"""The decoder layer's elementwise ops fused into one pass each (decoder_ops.c), for the engine's CPU forward.

Only inside `fused_scope()`, which the engine's model runner enters around its forward pass; everywhere
else (training, scoring, the trainer's logprob recompute) the model runs its PyTorch ops unchanged, which
autograd needs. Inside the scope a module asks `active(x)` and, when true, calls the fused op instead:
RMSNorm (layers.RMSNorm), the residual add with the next norm (DecoderLayer), the rotary embedding
(layers.apply_rotary) and silu(gate) * up (layers.SwiGLU). Results agree with the PyTorch ops to float
rounding (decoder_ops.c says where they may differ).

`active(x)` is true for fp32 CPU tensors with autograd off, when the kernels are built (see
posttrain.kernels: POSTTRAIN_CPU_KERNELS=0 turns them off, a missing compiler falls back).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from posttrain.kernels import library

_state = threading.local()  # per thread: a server's engine thread and a trainer thread do not mix


@contextmanager
def fused_scope() -> Iterator[None]:
    """Within it (in this thread), modules take the fused ops for tensors `active` accepts."""
    outer = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = outer


def active(x: torch.Tensor) -> bool:
    return (
        getattr(_state, "on", False)
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and library() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; x (..., d), weight (d,)."""
    x, weight = x.contiguous(), weight.detach().float().contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    library().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps, torch.get_num_threads())
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); x, delta (..., d) of one shape, weight (d,)."""
    x, delta, weight = x.contiguous(), delta.contiguous(), weight.detach().float().contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    d = x.shape[-1]
    library().add_rms_norm(
        x.data_ptr(),
        delta.data_ptr(),
        weight.data_ptr(),
        total.data_ptr(),
        out.data_ptr(),
        x.numel() // d,
        d,
        eps,
        torch.get_num_threads(),
    )
    return total, out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's rotate-half RoPE: x (..., H, D) with cos, sin (..., D) for the same leading tokens."""
    x, cos, sin = x.contiguous(), cos.float().contiguous(), sin.float().contiguous()
    heads, d = x.shape[-2:]
    tokens = x.numel() // (heads * d)
    if cos.numel() != tokens * d or sin.numel() != tokens * d:
        raise ValueError(f"rotary: cos/sin {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    out = torch.empty_like(x)
    library().rotary(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads, d, torch.get_num_threads()
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise over tensors of one shape."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    library().silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
    return out

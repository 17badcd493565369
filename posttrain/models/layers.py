"""The decoder's building blocks: RMSNorm, rotary position embedding (with its scaling variants), SwiGLU."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.kernels import fused


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float = 1e-6, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.active(x):  # the engine's CPU forward: one pass (posttrain/kernels/fused.py)
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); names match HF so LoRA target names carry over."""

    def __init__(self, dim: int, hidden: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, device=device)
        self.up_proj = nn.Linear(dim, hidden, bias=False, device=device)
        self.down_proj = nn.Linear(hidden, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused.silu_mul(gate, up) if fused.active(gate) else F.silu(gate) * up)


# ---- rotary embedding -------------------------------------------------------------------------------
# Each scaling variant is a function (head_dim, theta, scaling, max_positions, seq_len) -> (inv_freq, attention_factor),
# chosen by name from ROPE_VARIANTS. `seq_len` matters only for dynamic NTK.


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (D/2,)


def _rope_default(head_dim: int, theta: float, scaling: dict, max_pos: int, seq_len: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(head_dim, theta), 1.0


def _rope_linear(head_dim: int, theta: float, scaling: dict, max_pos: int, seq_len: int) -> tuple[torch.Tensor, float]:
    # Position interpolation: positions are divided by `factor`, i.e. frequencies are.
    return _base_inv_freq(head_dim, theta) / scaling["factor"], 1.0


def _rope_dynamic(head_dim: int, theta: float, scaling: dict, max_pos: int, seq_len: int) -> tuple[torch.Tensor, float]:
    # Dynamic NTK: past the trained length, grow the base so the lowest frequency still spans seq_len.
    factor = scaling["factor"]
    seq_len = max(seq_len, max_pos)
    base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _base_inv_freq(head_dim, base), 1.0


def _rope_yarn(head_dim: int, theta: float, scaling: dict, max_pos: int, seq_len: int) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, keep high ones, blend linearly in between; scale attention by mscale.
    original = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (D/2,)
    keep = 1 - ramp  # 1 = extrapolate (keep the original frequency), 0 = interpolate
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _rope_llama3(head_dim: int, theta: float, scaling: dict, max_pos: int, seq_len: int) -> tuple[torch.Tensor, float]:
    # Llama 3.1: divide long wavelengths by `factor`, keep short ones, smooth in between.
    inv_freq = _base_inv_freq(head_dim, theta)
    factor, low_ff, high_ff = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
    return torch.where(medium, smoothed, scaled), 1.0


ROPE_VARIANTS: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "default": _rope_default,
    "linear": _rope_linear,
    "dynamic": _rope_dynamic,
    "yarn": _rope_yarn,
    "llama3": _rope_llama3,
}


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) for given positions; `apply_rotary` rotates q and k with them."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling or {}
        self.rope_type = self.scaling.get("rope_type", "default")
        self.max_positions = max_positions
        inv_freq, self.attention_factor = ROPE_VARIANTS[self.rope_type](head_dim, theta, self.scaling, max_positions, 0)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...,) int -> cos, sin (..., head_dim) in fp32."""
        inv_freq = self.inv_freq
        if self.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
            if seq_len > self.max_positions:
                inv_freq = _rope_dynamic(self.head_dim, self.theta, self.scaling, self.max_positions, seq_len)[0]
                inv_freq = inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # (..., D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, H, D) with cos/sin (..., T, D): the rotate-half convention of HF Llama."""
    if fused.active(x):  # the engine's CPU forward: one pass (posttrain/kernels/fused.py)
        return fused.rotary(x, cos, sin)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # (..., T, 1, D)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's convention: dims (0, 1), (2, 3), ... are the rotated pairs. x (..., T, H, D), cos/sin
    (..., T, D) as RotaryEmbedding makes them (the two halves repeat, so the first half is per pair).

    The result comes out de-interleaved (rotated evens, then rotated odds), as transformers' DeepSeek-V3
    does: q and k get the same permutation, so their dot products are unchanged."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2).to(x.dtype), sin[..., :half].unsqueeze(-2).to(x.dtype)  # (..., T, 1, D/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

"""Pure tensor functions: round-to-nearest quantization, dequantization, int4 packing, int8 activations.

Shapes: a weight is (N, K) = (out_features, in_features); G = ceil(K / group_size) groups per row;
codes are centred int8 (code - 2**(bits-1)), see `posttrain.quant.schemes` for the value formula.
"""

from __future__ import annotations

import torch

from posttrain.errors import PosttrainError
from posttrain.quant.schemes import QuantScheme

TILE_ROWS = 64  # output rows per int4 tile; rows i and i + 32 of a tile share a byte


def grouped_view(w: torch.Tensor, group: int) -> torch.Tensor:
    """(N, K) -> (N, G, group); a short last group is filled with copies of the row's last weight, which
    leaves that group's min, max and absmax unchanged."""
    N, K = w.shape
    G = -(-K // group)
    if G * group != K:
        w = torch.cat([w, w[:, -1:].expand(N, G * group - K)], dim=1)
    return w.view(N, G, group)


def _per_column(t: torch.Tensor, group: int, K: int) -> torch.Tensor:
    """(N, G) per-group values -> (N, K), one per weight."""
    return t.repeat_interleave(group, dim=1)[:, :K]


def _to_storage(x: torch.Tensor, dtype: torch.dtype, what: str, source: str) -> torch.Tensor:
    out = x.to(dtype)
    if not bool(torch.isfinite(out).all()):
        raise PosttrainError(f"{source}: {what} do not fit in {dtype} (weights too large or not finite)")
    return out


def quantize_weight(
    w: torch.Tensor, scheme: QuantScheme, source: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, K) float -> (codes int8 (N, K) centred, scales (N, G), zeros (N, G) or None for symmetric).

    Scales (and zeros) are rounded to their storage dtype first and the codes computed against the
    rounded values, so dequantizing what is stored is exactly what this function meant.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise PosttrainError(f"{source}: expected a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    wg = grouped_view(w.detach().float(), scheme.effective_group_size(K))  # (N, G, g)
    scales, zeros = group_params(wg, scheme, source)
    codes = round_to_codes(wg, scales, zeros, scheme).view(N, -1)[:, :K]
    return codes.contiguous(), scales, zeros


def group_params(
    wg: torch.Tensor, scheme: QuantScheme, source: str = "weight", clip: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Grouped float weights (..., g) -> (scales (...), zeros (...) or None), in the scheme's storage dtype.

    The rounding grid of each group, from its values (see `posttrain.quant.schemes` for the rules).
    `clip` (a number, or one per group (...)) shrinks the range the grid spans: values beyond it are clamped
    to the end codes, and the grid gets finer for all the others (see `search_clip`)."""
    sdt = scheme.scale_dtype
    if scheme.symmetric:
        # The value of largest magnitude lands exactly on code -mid (llama.cpp's Q4_0 rule): all 2**bits codes
        # are used, and the scale is negative when that value is positive.
        extreme = wg.gather(-1, wg.abs().argmax(dim=-1, keepdim=True)).squeeze(-1) * clip  # (...), signed
        scales = _to_storage(extreme / -scheme.mid, sdt, "scales", source)
        return torch.where(scales == 0, torch.ones_like(scales), scales), None  # all-zero group: codes 0
    lo, hi = wg.amin(dim=-1) * clip, wg.amax(dim=-1) * clip  # (...)
    levels = (1 << scheme.bits) - 1
    # A constant group (hi == lo) gets a scale that keeps its value exact: w = q_min * s + zero.
    step = torch.where(hi > lo, (hi - lo) / levels, lo.abs() / scheme.mid)
    scales = _to_storage(step, sdt, "scales", source)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = _to_storage(lo + scheme.mid * scales.float(), sdt, "zero points", source)  # value of code 0
    return scales, zeros


CLIP_GRID = tuple(1.0 - 0.02 * i for i in range(16))  # 1.0 .. 0.70: the range shrinks `search_clip` tries


def search_clip(
    wg: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None = None, source: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The grids of `group_params` with, for each group, the clip of CLIP_GRID that minimises the rounding
    error sum_j importance_j (w_j - q_j)^2 over the group (importance (..., g), e.g. the inputs' mean square;
    None: plain squared error). Giving up the few largest weights of a group for a finer grid for the rest
    usually pays: at 16 levels one outlier otherwise sets the step for the whole group."""
    best_error = best_scales = best_zeros = None
    for clip in CLIP_GRID:
        scales, zeros = group_params(wg, scheme, source, clip)
        residual = codes_to_values(round_to_codes(wg, scales, zeros, scheme), scales, zeros) - wg  # (..., g)
        error = (residual.square() * (1.0 if importance is None else importance)).sum(dim=-1)  # (...)
        if best_error is None:
            best_error, best_scales, best_zeros = error, scales, zeros
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scales = torch.where(better, scales, best_scales)
        if zeros is not None:
            best_zeros = torch.where(better, zeros, best_zeros)
    return best_scales, best_zeros


def round_to_codes(
    wg: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Float weights (..., g) on the grids (scales / zeros (...)) -> nearest centred codes, int8 (..., g)."""
    shifted = wg if zeros is None else wg - zeros.float()[..., None]
    q = torch.round(shifted / scales.float()[..., None])
    return q.clamp_(scheme.q_min, scheme.q_max).to(torch.int8)


def codes_to_values(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """Centred codes (..., g) on the grids (scales / zeros (...)) -> fp32 weights (..., g)."""
    w = codes.float() * scales.float()[..., None]
    return w if zeros is None else w + zeros.float()[..., None]


def dequantize_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Centred codes (N, K) + scales/zeros (N, G) -> (N, K) weights in `dtype` (computed in fp32)."""
    N, K = codes.shape
    group = K if group_size is None else group_size
    w = codes.to(torch.float32)
    if K % group == 0:  # the common case: broadcast over a (N, G, group) view, in place
        view = w.view(N, K // group, group)
        view.mul_(scales.float()[..., None])
        if zeros is not None:
            view.add_(zeros.float()[..., None])
    else:
        w.mul_(_per_column(scales.float(), group, K))
        if zeros is not None:
            w.add_(_per_column(zeros.float(), group, K))
    return w.to(dtype)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """quantize then dequantize, in w's dtype: the weight the quantized model will really use."""
    codes, scales, zeros = quantize_weight(w, scheme)
    return dequantize_weight(codes, scales, zeros, scheme.group_size, w.dtype)


# ---- int4 packing ---------------------------------------------------------------------------------------
# Layout "tiles64": output rows are taken in tiles of 64 (N padded up to a multiple of 64 with code 0);
# tile t, input column k, byte i (0..31) holds the code of row 64t + i in its low nibble and of row
# 64t + 32 + i in its high nibble, codes stored unsigned (centred code + 8). Shape (ceil(N/64), K, 32).
# It is the order torch's CPU int4 kernel reads (`_weight_int4pack_mm_for_cpu`), so that kernel uses the
# stored bytes as they are; the pure-PyTorch path unpacks them with reshapes.


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Centred int4 codes (N, K) in [-8, 7] -> uint8 (ceil(N/64), K, 32)."""
    N, K = codes.shape
    tiles = -(-N // TILE_ROWS)
    u = (codes.to(torch.int16) + 8).to(torch.uint8)  # (N, K) in [0, 15]
    if tiles * TILE_ROWS != N:
        u = torch.cat([u, u.new_full((tiles * TILE_ROWS - N, K), 8)])  # pad rows hold the zero code
    u = u.view(tiles, 2, 32, K)  # (T, half, i, K)
    return (u[:, 0] | (u[:, 1] << 4)).transpose(1, 2).contiguous()  # (T, K, 32)


def unpack_int4(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """uint8 (T, K, 32) -> centred int8 codes (out_features, K)."""
    T, K, _ = packed.shape
    halves = torch.stack([packed & 15, packed >> 4], dim=1)  # (T, 2, K, 32)
    u = halves.transpose(2, 3).reshape(T * TILE_ROWS, K)[:out_features]  # (N, K)
    return u.to(torch.int8) - 8


# ---- activations (W8A8) ---------------------------------------------------------------------------------


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (int8 codes (M, K) in [-127, 127], fp32 scales (M, 1)): one absmax scale per row, i.e. one
    group of K."""
    return quantize_per_group(x, x.shape[-1])


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_per_token(x)
    return (codes.float() * scales).to(x.dtype)


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (int8 codes (M, K) in [-127, 127], fp32 scales (M, ceil(K / group))): one absmax scale per
    `group` inputs along each row (llama.cpp's Q8_0 blocks). The same fp32 division and rounding as
    posttrain/kernels/q8_linear.c, so the codes are its codes bit for bit."""
    xf = x.float()
    scales = (grouped_view(xf, group).abs().amax(dim=-1) / 127).clamp_(min=1e-12)  # (M, G); zero groups stay zero
    codes = torch.round(xf / _per_column(scales, group, xf.shape[1])).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def fake_quantize_activations(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """x (..., K) rounded as `scheme` rounds its activations (one scale per token, or per group of its group size
    along K) and dequantized again, in x's dtype: what the integer product sees."""
    x2d = x.reshape(-1, x.shape[-1])
    group = scheme.group_size or x2d.shape[1]
    codes, scales = quantize_per_group(x2d, group)
    return (codes.float() * _per_column(scales, group, x2d.shape[1])).to(x.dtype).view_as(x)

"""GPTQ: round a linear layer's weight to a scheme's grid column by column, correcting the columns not yet
rounded for the error of each one, so the layer's *outputs* on calibration inputs move as little as possible.

Pure tensor math on one weight; `gptq_model.py` walks a model and collects the inputs.

The objective, for a weight W (N, K) and calibration inputs X (M, K): minimise ||X W^T - X Q^T||^2 over Q on
the grid. With H = X^T X / M (K, K), rounding column j leaves an error e_j = w_j - q_j (N,); the best update of
the columns after j (in the order they are rounded) is -e_j / [H^-1]_jj * [H^-1]_j,j+1: (Frantar et al.,
2022, from Optimal Brain Surgeon). Taking the rows of H^-1 from the upper Cholesky factor U of H^-1
(H^-1 = U^T U) gives, for every column, exactly the inverse Hessian of the columns still to round, so one
factorisation serves the whole sweep. Updates inside a block of columns are applied at once; those to the
columns after the block are batched into one matmul per block.

Groups: a group's grid (scale, zero point) is computed when the sweep reaches its first column, from the
weights as corrected so far; the block size is a multiple of the group size, so a group never straddles two
blocks. With `act_order` the columns are rounded in order of decreasing H_jj (the inputs with the most
energy first, while the most columns remain to absorb their error); the grids are then fixed up front from
the original groups ("static groups"), so the stored layout stays the plain contiguous groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.errors import PosttrainError
from posttrain.quant.codec import codes_to_values, group_params, grouped_view, round_to_codes, search_clip
from posttrain.quant.schemes import QuantScheme


@dataclass(frozen=True)
class GPTQResult:
    codes: torch.Tensor  # (N, K) int8, centred
    scales: torch.Tensor  # (N, G), the scheme's scale dtype
    zeros: torch.Tensor | None  # (N, G) or None (symmetric)
    proxy_loss: float  # sum over columns of ||e_j||^2 / [H^-1]_jj / 2: the output error GPTQ minimises


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    clip_search: bool = False,
    source: str = "weight",
) -> GPTQResult:
    """Quantize `weight` (N, K) to `scheme` given `hessian` (K, K) = X^T X / M of its calibration inputs.

    `damp`: fraction of the mean diagonal added to the diagonal (keeps H invertible, as for inputs that are
    always zero or collinear). `clip_search`: each group's grid is the clip of `codec.search_clip` with the
    least rounding error weighted by the inputs' mean square (H_jj). Returns codes and grids in the layout
    `quantize_weight` produces.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise PosttrainError(f"{source}: expected a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}")
    N, K = weight.shape
    if hessian.shape != (K, K):
        raise PosttrainError(f"{source}: the Hessian is {tuple(hessian.shape)}, expected ({K}, {K})")
    if not damp > 0:
        raise PosttrainError(f"{source}: damp must be > 0, got {damp}")
    group = scheme.effective_group_size(K)
    block = max(1, block_size // group) * group if group <= block_size else group  # groups never straddle blocks

    W = weight.detach().float().clone()  # (N, K), corrected in place as the sweep goes
    H = hessian.detach().double().clone()  # (K, K); fp64: the Cholesky factorisations of a near-singular H
    dead = H.diagonal() == 0  # inputs that were always zero: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    energy = H.diagonal().float()  # (K,) the inputs' mean square: how much each column's error costs

    def grid(w: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grids of grouped weights w (N, G', g) whose columns are `columns` (G', g), -1 = padding."""
        if not clip_search:
            return group_params(w, scheme, source)
        importance = torch.where(columns >= 0, energy[columns.clamp(min=0)], 0.0)  # padding costs nothing
        return search_clip(w, scheme, importance, source)

    G = scheme.num_groups(K)
    static = act_order or group == K  # per-channel grids are fixed from the whole row up front
    if static:
        columns = F.pad(torch.arange(K), (0, G * group - K), value=-1).view(G, group)
        scales, zeros = grid(grouped_view(W, group), columns)  # (N, G)
    order = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(K)
    W, H = W[:, order], H[order][:, order]
    group_of = (order // group).tolist()  # the (original) group of each column, in sweep order

    U = _inverse_cholesky_upper(H, damp, source).float()  # (K, K): row j = H^-1 of columns j.. , scaled
    if not static:
        scales = torch.empty(N, G, dtype=scheme.scale_dtype)
        zeros = None if scheme.symmetric else torch.empty(N, G, dtype=scheme.scale_dtype)
    codes = torch.empty(N, K, dtype=torch.int8)
    loss = 0.0
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()  # (N, b)
        E1 = torch.zeros_like(W1)  # (N, b) scaled errors, to carry to the columns after the block
        U1 = U[i1:i2, i1:i2]  # (b, b)
        for i in range(i2 - i1):
            column = i1 + i
            g = group_of[column]
            if not static and column % group == 0:  # a group starts: its grid from the corrected weights
                w_group = W1[:, i : i + group]  # (N, g), the last group may be shorter
                s, z = grid(w_group[:, None, :], torch.arange(column, column + w_group.shape[1])[None, :])  # (N, 1)
                scales[:, g] = s[:, 0]
                if zeros is not None:
                    zeros[:, g] = z[:, 0]
            s, z = scales[:, g], None if zeros is None else zeros[:, g]  # (N,)
            w = W1[:, i]  # (N,)
            q = round_to_codes(w[:, None], s, z, scheme)  # (N, 1)
            codes[:, column] = q[:, 0]
            d = U1[i, i]
            err = (w - codes_to_values(q, s, z)[:, 0]) / d  # (N,)
            loss += float(err.square().sum()) / 2
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    inverse = torch.argsort(order)
    return GPTQResult(codes[:, inverse].contiguous(), scales, zeros, loss)


def _inverse_cholesky_upper(H: torch.Tensor, damp: float, source: str) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, so that H^-1 = U^T U. The damping grows
    tenfold (up to 3 tries) when H is still not positive definite."""
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    mean_diag = float(H.diagonal().mean())
    for attempt in range(3):
        L, info = torch.linalg.cholesky_ex(H + (damp * 10**attempt) * mean_diag * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return U
    raise PosttrainError(
        f"{source}: the calibration Hessian is not positive definite even with damp={damp * 100} "
        "(more or more varied calibration text, or a larger --damp)"
    )

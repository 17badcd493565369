"""Statistics over the valid entries of a tensor, given a 0/1 mask of the same shape.

Entries outside the mask may hold anything, NaN included (padding, unscorable samples): they are
replaced by zero before summing, so they can never leak into a statistic.
"""

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask), ignoring whatever sits where mask == 0 (even NaN or inf)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / sum(mask); 0 (not NaN) where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) over the masked entries; 0 outside the mask.

    Follows verl's `masked_whiten` (verl/utils/torch_functional.py): the mean is shifted out and the
    variance is the unbiased (Bessel-corrected) one. verl raises when fewer than two entries are valid;
    here the variance is undefined then, so the result is all zeros (no learning signal, no NaN).
    """
    count = mask.sum()
    if count < 2:
        return torch.zeros_like(values)
    mean = masked_mean(values, mask)
    centered = values - mean
    var = masked_sum(centered**2, mask) / (count - 1)
    whitened = centered * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))

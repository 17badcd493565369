"""The bounds of tests/numeric.py against the computations they bound."""

from __future__ import annotations

import pytest
import torch

from tests.numeric import EQUIVALENCE_EPS, REORDER_RTOL, adam_drift, reorder_rtol


def test_reordered_sums_stay_within_the_bound():
    """A 49152-term fp32 sum (the vocabulary's) in 64 orders: each within reorder_rtol(1) of the fp64 sum,
    relative to the sum of the terms' magnitudes."""
    generator = torch.Generator().manual_seed(0)
    terms = torch.randn(49152, generator=generator) * torch.rand(49152, generator=generator).exp()
    exact = terms.double().sum().item()
    scale = terms.abs().double().sum().item()
    for _ in range(64):
        shuffled = terms[torch.randperm(terms.numel(), generator=generator)]
        for total in (shuffled.sum(), shuffled.view(-1, 16).sum(0).sum(), shuffled.cumsum(0)[-1]):
            assert abs(total.item() - exact) <= reorder_rtol(1) * scale


@pytest.mark.parametrize("steps", [1, 3])
def test_adamw_follows_a_gradients_rounding_within_adam_drift(steps: int):
    """Two AdamW runs whose clipped gradients differ by the reorder bound, including entries near zero and near
    eps, where AdamW's step is most sensitive: every weight ends within adam_drift."""
    lr = 1e-2
    generator = torch.Generator().manual_seed(steps)
    runs = [torch.zeros(4096, requires_grad=True) for _ in range(2)]
    optimizers = [torch.optim.AdamW([w], lr=lr, eps=EQUIVALENCE_EPS, weight_decay=0.1) for w in runs]
    for _ in range(steps):
        grad = torch.randn(4096, generator=generator) * torch.logspace(-9, -1, 4096)  # magnitudes 1e-9 .. 0.1
        grad = grad / grad.norm()  # clipped to max_grad_norm = 1
        noise = torch.randn(4096, generator=generator)
        for w, g in zip(runs, (grad, grad + REORDER_RTOL * noise / noise.norm())):
            w.grad = g.clone()
        for optimizer in optimizers:
            optimizer.step()
    difference = (runs[0] - runs[1]).abs().max().item()
    assert 0 < difference <= adam_drift(lr, steps, EQUIVALENCE_EPS)


def test_adam_drift_refuses_an_eps_that_makes_the_bound_meaningless():
    with pytest.raises(ValueError, match=r"optim.eps=1e-08 lets AdamW's step follow the gradient's rounding"):
        adam_drift(1e-2, 1, 1e-8)

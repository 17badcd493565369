"""What two fp32 computations of one result can promise each other when they differ only in the order of their
sums, and what AdamW makes of that: the bounds the equivalence tests (2 processes against 1, micro-batched against
whole, packed against padded, a C kernel against its PyTorch reference) hold results to, stated once.

Reordering. Another split over ranks or micro-batches, the GEMM blocking MKL picks for another row count (rows of
a smaller batch come out ~2 eps apart) or another CPU, a kernel's vector width: each changes the order in which
a sum's roundings happen. A sum of n terms in a blocked, vectorised or tree order takes ~log2(n) roundings on
any path; its result moves by those roundings' errors, each at most u = 2^-24 relative to the magnitude of the
terms. Taken as independent and zero-mean (Higham & Mary, "A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 2019), the errors of N roundings add up like a random walk: each run's error
has a standard deviation of u * sqrt(N / 3), the difference of two runs sqrt(2) times that, and `reorder_rtol`
allows 12 of those deviations, which independent errors exceed with a probability below 1e-30. (Where errors do
not average out, a long serial loop over positive terms, `serial_sum_rtol` gives the worst case instead.)

The bound is relative to the magnitude of the terms, not of the result: per-token losses or log-probability gaps
of order one can average to nearly zero (a KL before the first update), so a scalar result is held to
rtol * max(1, |result|), a tensor to rtol * its largest entry.

AdamW. See `adam_drift`: it turns a gradient's reorder bound into a bound on the weights after some updates. Its
gain is lr / eps; with the default eps = 1e-8 a weight whose gradient is at rounding level (an LM-head row of a
token no row uses) takes a step of any size up to lr depending on the summation order, so the equivalence tests
train with optim.eps = 1e-3 (EQUIVALENCE_EPS), where AdamW's step lr * g / (|g| + eps) still has the size lr for
the gradients that carry the data and follows a gradient's rounding with a gain of at most 2 lr / eps.
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: the spacing of fp32 numbers at 1
UNIT_ROUNDOFF = EPS32 / 2  # u: the most one rounding moves a result, relative
EQUIVALENCE_EPS = 1e-3  # optim.eps for runs compared after AdamW updates (see `adam_drift`)


def reorder_rtol(reordered_sums: int, longest_sum: int = 2**16) -> float:
    """The relative bound for a result whose path passes through this many sums in another order, of at most
    `longest_sum` terms each: 12 standard deviations of the difference of two runs' rounding errors."""
    roundings = reordered_sums * math.log2(longest_sum)
    return 12 * math.sqrt(2 * roundings / 3) * UNIT_ROUNDOFF


def serial_sum_rtol(terms: int) -> float:
    """The worst case of one serial loop adding `terms` terms: each addition's rounding, all the same way."""
    return terms * UNIT_ROUNDOFF


# The tests' tiny 2-layer models, one run against another: every sum of the forward may be reordered (rows in a
# batch of another size, another arrangement or implementation). Per layer RMSNorm, q/k/v, scores, softmax,
# weights x values, o_proj, RMSNorm, gate/up, down (9); 2 layers, then the final norm, the LM head, the
# log-softmax's sum and the mean over tokens: 22 on any path; a gradient adds the backward's as many. 44 sums of
# < 2^16 terms (the 49152-token vocabulary the longest): 1.55e-5.
REORDER_RTOL = reorder_rtol(44)


def reorder_tolerance(reference: float, rtol: float = REORDER_RTOL) -> float:
    """How far a scalar another summation order computed may lie from `reference` (module docstring)."""
    return rtol * max(1.0, abs(reference))


def reorder_close(got: float, want: float, rtol: float = REORDER_RTOL) -> bool:
    return abs(got - want) <= reorder_tolerance(want, rtol)


def assert_reordered(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = REORDER_RTOL, msg: str | None = None
) -> None:
    """actual equals expected up to reordered sums: each entry within rtol of expected's largest entry (the scale
    of the terms an entry sums, which a near-zero entry reached by cancellation still has) plus rtol of itself."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=rtol * max(scale, torch.finfo(expected.dtype).tiny), msg=msg
    )


def adam_drift(lr: float, updates: int, eps: float, max_grad_norm: float = 1.0, rtol: float = REORDER_RTOL) -> float:
    """How far apart two runs' weights can be after `updates` AdamW steps whose gradients differ only by reordering:
    a bound on every weight's difference and on the L2 distance of the weight vectors.

    The gradient is clipped to norm <= max_grad_norm, so the runs' gradients differ by delta <= rtol * max_grad_norm
    (in L2, hence in every entry), the clip factor's own rounding being of the same order. An update moves a weight
    by lr * m / (sqrt(v) + eps) with m, v the bias-corrected moments (the decoupled weight decay is the same for the
    same weight): m is a weighted mean of this and earlier gradients and sqrt(v) a weighted RMS, so each moves by at
    most delta, and m / (sqrt(v) + eps) by at most delta / eps + |m| / (sqrt(v) + eps) * delta / eps <= 2 delta / eps
    (|m| <= sqrt(v) to 1% over the first few steps). lr: the largest any parameter group has (schedules stay below).

    First order: the bound adds up each update's own reordering. The drift an earlier update leaves also moves the
    later gradients (curvature times drift); over the few (<= 4) updates these tests take, the margin between
    rtol * max_grad_norm and the reorder error runs actually show (a weight drift of ~1e-7 after one update of
    lr 1e-2, where this bound gives 3e-4) holds that term.
    """
    gain = rtol * max_grad_norm / eps  # the most an update's size, in units of lr, can follow the rounding
    if gain > 0.05:
        raise ValueError(
            f"optim.eps={eps} lets AdamW's step follow the gradient's rounding ({gain:.2g} lr a step): "
            f"compare runs with optim.eps >= {rtol * max_grad_norm / 0.05:.1g} (tests/numeric.py)"
        )
    return 2 * lr * gain * updates


def loss_after_updates_tolerance(loss: float, grad_norm: float, drift: float, rtol: float = REORDER_RTOL) -> float:
    """How far a loss can lie from `loss` when it is computed at weights the runs hold up to `drift` apart (L2,
    `adam_drift` of the updates before it): its own reordering plus, to first order, |grad L| * drift, with
    grad_norm the norm of that loss's gradient at those weights (what the trainers log, before clipping)."""
    return reorder_tolerance(loss, rtol) + grad_norm * drift


# bf16 (CUDA runs). bf16 keeps 8 significant bits, so one rounding moves a result by up to 2^-9 relative, and two
# implementations round their intermediates (activations, attention weights, partial sums) at different points.
# No random-walk argument holds at this precision over so few roundings, so the bound is the worst case: every
# rounding of both runs one way. What it can catch is structure (a wrong mask, position or scale moves logits by
# their own size), not the last bits.
BF16_UNIT_ROUNDOFF = 2.0**-9


def bf16_rtol(roundings: int) -> float:
    """How far two bf16 computations, each through `roundings` roundings, may lie apart, relative to the scale."""
    return 2 * roundings * BF16_UNIT_ROUNDOFF

"""Per-token estimators of KL(pi || pi_ref) on tokens sampled from pi (Schulman, "Approximating KL
Divergence", 2020, http://joschu.net/blog/kl-approx.html).

With log r = log pi_ref(y) - log pi(y) for a sampled token y:
    k1 = -log r                 unbiased, high variance, can be negative
    k2 = (log r)^2 / 2          biased, low variance, >= 0; its gradient is the gradient of KL
    k3 = (r - 1) - log r        unbiased, low variance, >= 0 (GRPO's KL term, TRL and verl)
`low_var_kl` is k3 with verl's clamps (verl/trainer/ppo/core_algos.py `kl_penalty_forward`):
log r clamped to [-20, 20] before exp, the result to [-10, 10], so a token where the policy has
drifted far from the reference cannot blow up the loss (at the price of bias on those tokens).

All functions: logprobs, ref_logprobs (B, T) -> per-token KL (B, T). Masking is the caller's
(an aggregation from `posttrain.algos.aggregation`).
"""

from collections.abc import Callable

import torch
from torch import Tensor


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi(y) - log pi_ref(y)."""
    return logprobs - ref_logprobs  # (B, T)


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi(y) - log pi_ref(y))^2 / 2."""
    return 0.5 * (logprobs - ref_logprobs).square()  # (B, T)


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(log r) - 1 - log r with log r = log pi_ref(y) - log pi(y).

    Written as expm1(log r) - log r: the same value, without the cancellation of exp(x) - 1 near 0.
    """
    log_r = ref_logprobs - logprobs  # (B, T)
    return torch.expm1(log_r) - log_r  # (B, T)


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 with verl's stability clamps: log r in [-20, 20], result in [-10, 10]."""
    log_r = (ref_logprobs - logprobs).clamp(min=-20.0, max=20.0)  # (B, T)
    return (torch.expm1(log_r) - log_r).clamp(min=-10.0, max=10.0)  # (B, T)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "low_var_kl": low_var_kl,
}

"""The RL objective of one (micro-)batch as one pure function: tensors and plain hyperparameters in, loss
sums with their normalisers and detached metrics out.

Per token, with w the off-policy weight of pi_old against the sampler (`importance`: truncated or masked IS,
per token or per sequence; 1 when off):

    l_t = w_t * policy_loss_t(logprobs, old_logprobs, advantages)
          + kl_coef * KL_t(pi || pi_ref) - entropy_coef * H_t

    policy term = aggregation numerator of l  /  aggregation denominator      (see `aggregation`)
    value term  = sum of the clipped value loss (PPO)  /  valid tokens        (token-mean)

Each term comes back as a `LossSum`: the numerator and this batch's part of the denominator, both of
which add up over micro-batches. A trainer that splits a minibatch divides each micro-batch's sums by the
minibatch's denominators (counted from the masks before the first forward), so the accumulated gradient
is that of the whole minibatch at once; one batch on its own gives `LossSum.mean()`.

How TRL's GRPOTrainer `loss_type` values map here (trl 1.16 `_compute_loss`; tests/algos/test_trl_grpo.py):
    grpo    = ppo_clip + seq-mean-token-mean      bnpo    = ppo_clip + token-mean
    dr_grpo = ppo_clip + seq-mean-token-sum-norm  dapo    = dapo + token-mean
with TRL's beta the kl_coef (k3), and its vLLM importance-sampling correction the off-policy weight
(token_truncate / sequence_truncate: tis; token_mask / sequence_mask: mis, up to the weight of kept samples). TRL's entropy bonus is always a token mean; here it is aggregated with the policy term, which is
the same thing under token-mean (bnpo, dapo) only.

Shapes: logprobs, old_logprobs, rollout_logprobs, ref_logprobs, entropy, values, old_values, returns and
mask (B, T); advantages (B,) per sequence or (B, T) per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posttrain.algos.aggregation import AGGREGATIONS, token_mean
from posttrain.algos.importance import OffPolicyParams, off_policy_weights
from posttrain.algos.kl import KL_ESTIMATORS
from posttrain.algos.losses import POLICY_LOSSES, value_loss
from posttrain.algos.masked import masked_mean


@dataclass(frozen=True)
class ObjectiveParams:
    """The objective's hyperparameters, as plain values."""

    policy_loss: str  # POLICY_LOSSES key
    aggregation: str  # AGGREGATIONS key
    max_len: int  # the configured maximum response length (read by seq-mean-token-sum-norm)
    loss_params: Mapping[str, Any] = field(default_factory=dict)  # the policy loss's keywords (clip range, ...)
    off_policy: OffPolicyParams | None = None  # IS correction against the sampler's logprobs; None: off
    kl_estimator: str = "k3"  # KL_ESTIMATORS key
    kl_coef: float = 0.0  # weight of the KL loss term; 0 with ref_logprobs given: KL measured, not optimised
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted)
    value_clip: float = 0.2  # PPO's value clip range

    def __post_init__(self) -> None:
        for name, registry in (
            ("policy_loss", POLICY_LOSSES),
            ("aggregation", AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
        ):
            if getattr(self, name) not in registry:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {', '.join(registry)}")


@dataclass
class LossSum:
    """A loss term as numerator and denominator (0-dim tensors); the numerator carries the gradient."""

    sum: Tensor
    normaliser: Tensor

    def mean(self) -> Tensor:
        """The term over this batch alone; 0 when nothing is valid."""
        return self.sum / self.normaliser.clamp(min=1)


@dataclass
class Objective:
    policy: LossSum  # policy loss (x TIS weight) + KL term - entropy bonus, by the aggregation
    value: LossSum | None  # PPO's clipped value loss, by token (None without values)
    metrics: dict[str, Tensor]  # detached, each a mean over the valid tokens (ratio/max: a max)


def rl_objective(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: ObjectiveParams,
    *,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    values: Tensor | None = None,
    old_values: Tensor | None = None,
    returns: Tensor | None = None,
) -> Objective:
    """The objective over one batch (see the module docstring).

    old_logprobs None: pi_old is logprobs itself, detached (a single update per rollout: ratio 1).
    rollout_logprobs: the sampler's (behaviour policy's) logprobs, needed with off_policy. ref_logprobs: the reference policy's,
    needed with kl_coef > 0 (given with kl_coef 0, the KL is only measured). entropy: needed with
    entropy_coef > 0 (given otherwise, only measured). values, old_values, returns: all three or none.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    per_token, metrics = POLICY_LOSSES[params.policy_loss](logprobs, old, advantages, mask, **params.loss_params)
    if params.off_policy is not None:
        if rollout_logprobs is None:
            raise ValueError("off_policy needs rollout_logprobs, the sampler's logprobs")
        weight, weight_metrics = off_policy_weights(old, rollout_logprobs, mask, params.off_policy)  # (B, T)
        per_token = per_token * weight
        metrics.update(weight_metrics)
    if ref_logprobs is not None:
        kl = KL_ESTIMATORS[params.kl_estimator](logprobs, ref_logprobs)  # (B, T)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if params.kl_coef:
            per_token = per_token + params.kl_coef * kl
    elif params.kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs, the reference policy's logprobs")
    if entropy is not None:
        if params.entropy_coef > 0:
            per_token = per_token - params.entropy_coef * entropy
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    elif params.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the entropy")
    aggregation = AGGREGATIONS[params.aggregation]
    policy = LossSum(
        aggregation.numerator(per_token, mask, params.max_len), aggregation.denominator(mask, params.max_len)
    )
    value = None
    if values is not None:
        if old_values is None or returns is None:
            raise ValueError("the value loss needs values, old_values and returns")
        per_token_value, value_metrics = value_loss(values, old_values, returns, mask, clip_eps=params.value_clip)
        value = LossSum(token_mean.numerator(per_token_value, mask, None), token_mean.denominator(mask, None))
        metrics.update(value_metrics)
        metrics["value/mean"] = masked_mean(values.detach(), mask)
    return Objective(policy, value, metrics)


@torch.no_grad()
def sampler_mismatch(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """|log pi_trainer - log pi_sampler| over the valid tokens: its mean and max (the same weights should
    give ~0; a growing value says the two forwards disagree)."""
    diff = (logprobs - rollout_logprobs).abs() * mask  # (B, T)
    return {"mismatch/abs_diff_mean": masked_mean(diff, mask), "mismatch/abs_diff_max": diff.max()}

"""Policy-gradient and value losses for PPO / GRPO-family training.

A policy loss returns the per-token loss (B, T), zero outside the mask, plus detached metrics;
`posttrain.algos.objective.rl_objective` then weighs it (TIS), adds the KL and entropy terms and
reduces it with an `AGGREGATIONS` entry, in effect:

    per_token, metrics = POLICY_LOSSES[name](logprobs, old_logprobs, advantages, mask, **params)
    per_token = per_token + beta * KL_ESTIMATORS["k3"](logprobs, ref_logprobs)
    loss = AGGREGATIONS["seq-mean-token-mean"](per_token, mask, max_len=max_len)

How TRL's GRPOTrainer `loss_type` values map here (checked against trl 1.16 `_compute_loss`):
    grpo    = ppo_clip + seq-mean-token-mean      bnpo    = ppo_clip + token-mean
    dr_grpo = ppo_clip + seq-mean-token-sum-norm  dapo    = dapo + token-mean
    GSPO (importance_sampling_level="sequence")   = gspo + seq-mean-token-mean

Shapes: logprobs, old_logprobs, mask (B, T); advantages (B,) per sequence or (B, T) per token.
Metrics (0-dim tensors, over valid tokens): clip_frac/low = share of tokens with ratio < 1 - eps_low
and A < 0 (the clip is active there), clip_frac/high likewise for ratio > 1 + eps_high and A > 0,
approx_kl = k3 estimate of KL(pi_old || pi_theta) on the sampled tokens, ratio/mean, ratio/max.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algos.aggregation import AGGREGATIONS
from posttrain.algos.logprobs import entropy_from_logits
from posttrain.algos.masked import masked_mean

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "dapo_loss",
    "entropy_from_logits",
    "gspo_loss",
    "ppo_clip_loss",
    "value_loss",
]

LossWithMetrics = tuple[Tensor, dict[str, Tensor]]


def _per_token(advantages: Tensor) -> Tensor:
    """(B,) or (B, T) advantages -> broadcastable against (B, T)."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)


@torch.no_grad()
def _ratio_metrics(
    ratio: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """Clip fractions, approx KL and ratio statistics over the valid tokens."""
    advantages = advantages.expand_as(ratio)  # (B, T)
    low = (ratio < 1 - eps_low) & (advantages < 0)  # (B, T) lower clip active
    high = (ratio > 1 + eps_high) & (advantages > 0)  # (B, T) upper clip active
    # KL(pi_old || pi) on tokens sampled from pi_old: k3 with r = pi / pi_old
    approx_kl = torch.expm1(log_ratio) - log_ratio  # (B, T)
    valid = mask.bool()
    ratio_max = ratio[valid].max() if valid.any() else ratio.new_zeros(())
    return {
        "clip_frac/low": masked_mean(low.to(ratio.dtype), mask),
        "clip_frac/high": masked_mean(high.to(ratio.dtype), mask),
        "approx_kl": masked_mean(approx_kl, mask),
        "ratio/mean": masked_mean(ratio, mask),
        "ratio/max": ratio_max,
    }


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> Tensor:
    """max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)), optionally dual-clipped."""
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        # Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): for A < 0 the clipped objective is still
        # unbounded as ratio grows; cap the loss at -A * c (verl's clip_ratio_c).
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss


def _token_ratio_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> LossWithMetrics:
    """The clipped surrogate on token-level ratios r_t = exp(log pi - log pi_old), range [1 - eps_low, 1 + eps_high]
    (PPO's is symmetric, DAPO's decoupled). Returns the per-token loss (B, T), zero outside the mask, and metrics."""
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = _per_token(advantages)
    loss = _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip) * mask  # (B, T)
    return loss, _ratio_metrics(ratio.detach(), log_ratio.detach(), adv, mask, eps_low, eps_high)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
) -> LossWithMetrics:
    """PPO clipped surrogate with a token-level ratio (Schulman et al. 2017; GRPO uses it as is).

        r_t = exp(log pi(y_t) - log pi_old(y_t))
        l_t = -min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)
    Same as TRL GRPOTrainer's per-token loss and verl's `compute_policy_loss_vanilla` (verl also
    clamps log r to [-20, 20] and always dual-clips with c = 3; here dual_clip=None, as TRL).
    Returns the per-token loss (B, T), zero outside the mask, and metrics.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    return _token_ratio_loss(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps, dual_clip)


def dapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> LossWithMetrics:
    """DAPO clip-higher (Yu et al. 2025, arXiv:2503.14476, eq. 10): decoupled clip range.

        l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    A larger eps_high lets low-probability tokens with A > 0 grow further, against entropy collapse.
    Defaults are the paper's (0.2, 0.28). Aggregate with token-mean, as DAPO does.
    Returns the per-token loss (B, T), zero outside the mask, and metrics.
    """
    return _token_ratio_loss(logprobs, old_logprobs, advantages, mask, clip_eps_low, clip_eps_high, dual_clip)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
) -> LossWithMetrics:
    """GSPO: a sequence-level ratio, the geometric mean of token ratios (Zheng et al. 2025, arXiv:2507.18071).

        s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log r_{i,t})
        J   = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    Written in the paper's GSPO-token form, s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]: every
    valid token of row i carries the value s_i and the gradient s_i * d log pi(y_{i,t}), so with a
    per-sequence advantage and the seq-mean-token-mean aggregation the loss and its gradient are
    exactly GSPO's (also TRL's importance_sampling_level="sequence" and verl's "gspo"; verl clamps
    log s to <= 10, not done here). Token-level advantages (B, T) give GSPO-token.
    Defaults are the paper's clip range (3e-4, 4e-4). Clip fractions count sequences' tokens.
    Returns the per-token loss (B, T), zero outside the mask, and metrics.
    """
    log_ratio = logprobs - old_logprobs  # (B, T)
    mask_f = mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)  # (B,)
    log_s = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()  # (B, T), value log s_i
    seq_ratio = torch.exp(log_s)  # (B, T)
    adv = _per_token(advantages)
    loss = _clipped_surrogate(seq_ratio, adv, clip_eps_low, clip_eps_high, None) * mask  # (B, T)
    metrics = _ratio_metrics(seq_ratio.detach(), log_s.detach(), adv, mask, clip_eps_low, clip_eps_high)
    # approx_kl stays a token-level diagnostic: KL(pi_old || pi) from the token ratios
    metrics["approx_kl"] = masked_mean((torch.expm1(log_ratio) - log_ratio).detach(), mask)
    return loss, metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_eps: float = 0.2
) -> LossWithMetrics:
    """PPO clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2).

    As in TRL's PPOTrainer and verl's `compute_value_loss` (they then aggregate with token-mean).
    values (the critic now), old_values (at rollout), returns (GAE targets), mask: (B, T).
    Returns the per-token loss (B, T), zero outside the mask, and {"value/clip_frac": share of
    tokens where the clipped term is the larger one}.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)  # (B, T)
    unclipped_loss = (values - returns).square()  # (B, T)
    clipped_loss = (clipped_values - returns).square()  # (B, T)
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss) * mask  # (B, T)
    clip_frac = masked_mean((clipped_loss > unclipped_loss).to(loss.dtype), mask).detach()
    return loss, {"value/clip_frac": clip_frac}


POLICY_LOSSES: dict[str, Callable[..., LossWithMetrics]] = {
    "ppo_clip": ppo_clip_loss,
    "grpo": ppo_clip_loss,  # GRPO's surrogate is PPO's; what differs is advantages and aggregation
    "dapo": dapo_loss,
    "gspo": gspo_loss,
}

"""Off-policy correction: importance weights of the trainer's pi_old against the behaviour policy that sampled.

The behaviour policy is whatever produced the samples and their logprobs: the rollout engine at other numerics
(bf16 rollouts, fp32 training), or an older policy (asynchronous RL's stale samples). Nothing here knows which.

    log r_t = log pi_old(y_t) - log mu(y_t)                                  per token
    log r   = sum_t mask_t * log r_t                                         per sequence (the product of ratios)

Three corrections (`CORRECTIONS`), each per token or per sequence (`LEVELS`; a sequence's weight is broadcast to
its tokens; decoupled: per token only, as AReaL):
- "tis", truncated IS:  w = min(r, cap)                                   (verl rollout_is, TRL *_truncate)
- "mis", masked IS:     w = 1 if low <= r <= high else 0                  (verl rollout_rs, TRL *_mask)
- "decoupled", AReaL's behaviour weight: w = r if r <= cap else 0        (AReaL use_decoupled_loss with
  behav_imp_weight_cap = cap). With pi_old the proximal policy (recomputed by the trainer at the weights the update
  starts from), the clipped loss around it times this weight is AReaL's decoupled PPO objective
  (`posttrain.algos.decoupled`).
  A masked token keeps its place in the loss's normaliser, as in TRL (whose masked weight is 0); verl takes it
  out of the response mask instead, which changes the normaliser only. MIS leaves in-range samples unweighted,
  as verl's rejection sampling does (TRL's *_mask keeps the ratio r as their weight).

Ratios are exponentiated from log space clamped to +-SAFETY_BOUND (verl's exp(+-20)), so a long sequence's product
never overflows; MIS compares in log space, so its bounds are exact. The weights carry no gradient.

Shapes: old_logprobs, behaviour_logprobs, mask (B, T); weights (B, T).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # |log ratio| above this is clamped before exp: e^20 ~ 4.9e8


def token_log_ratios(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Each token its own ratio (0 on padding, whatever it held). (B, T) -> (B, T)."""
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def sequence_log_ratios(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Each token its sequence's ratio: the sum of the masked token log ratios. (B, T) -> (B, T)."""
    return masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)


LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"token": token_log_ratios, "sequence": sequence_log_ratios}


@dataclass(frozen=True)
class OffPolicyParams:
    """Which correction, at which level, with which bounds."""

    mode: str  # CORRECTIONS key: tis | mis | decoupled
    level: str = "token"  # LEVELS key
    cap: float = 2.0  # tis: the largest weight (verl's rollout_is_threshold default)
    low: float | None = None  # mis: the smallest ratio kept; None: 1 / high (verl's default)
    high: float = 2.0  # mis: the largest ratio kept

    def __post_init__(self) -> None:
        if self.mode not in CORRECTIONS:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(CORRECTIONS)}")
        if self.level not in LEVELS:
            raise ValueError(f"level {self.level!r} is not one of {', '.join(LEVELS)}")
        if self.mode == "decoupled" and self.level != "token":
            raise ValueError(
                "the decoupled correction weighs each token (AReaL's behaviour weight): level must be token"
            )
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0, got {self.cap}")
        if not self.high > 0 or (self.low is not None and not 0 <= self.low <= self.high):
            raise ValueError(f"need 0 <= low <= high and high > 0, got low={self.low}, high={self.high}")

    @property
    def low_bound(self) -> float:
        return 1.0 / self.high if self.low is None else self.low


def truncated_weights(log_ratio: Tensor, params: OffPolicyParams) -> tuple[Tensor, Tensor]:
    """TIS: (min(r, cap), where r was truncated). (B, T) -> (B, T), (B, T) bool."""
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return ratio.clamp(max=params.cap), ratio > params.cap


def masked_weights(log_ratio: Tensor, params: OffPolicyParams) -> tuple[Tensor, Tensor]:
    """MIS: (1 inside [low, high] else 0, where r fell outside). (B, T) -> (B, T), (B, T) bool."""
    low = math.log(params.low_bound) if params.low_bound > 0 else -math.inf
    outside = (log_ratio < low) | (log_ratio > math.log(params.high))
    return (~outside).to(log_ratio.dtype), outside


def behaviour_weights(log_ratio: Tensor, params: OffPolicyParams) -> tuple[Tensor, Tensor]:
    """Decoupled (AReaL): (r where r <= cap else 0, where r exceeded cap). (B, T) -> (B, T), (B, T) bool."""
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    over = ratio > params.cap
    return torch.where(over, torch.zeros_like(ratio), ratio), over


CORRECTIONS: dict[str, Callable[[Tensor, OffPolicyParams], tuple[Tensor, Tensor]]] = {
    "tis": truncated_weights,
    "mis": masked_weights,
    "decoupled": behaviour_weights,
}
AFFECTED_METRIC = {
    "tis": "off_policy/truncated_frac",
    "mis": "off_policy/masked_frac",
    "decoupled": "off_policy/masked_frac",
}


@torch.no_grad()
def off_policy_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, params: OffPolicyParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """The (B, T) weights of the correction `params` names (0 on padding), and its metrics over the valid tokens:
    the weights' mean and max, the largest raw ratio, and the share of tokens truncated (tis) or masked (mis)."""
    log_ratio = LEVELS[params.level](old_logprobs - behaviour_logprobs, mask)  # (B, T)
    weight, affected = CORRECTIONS[params.mode](log_ratio, params)
    weight = weight * mask
    valid = mask.bool()
    no_token = torch.tensor(0.0, device=weight.device)
    metrics = {
        "off_policy/weight_mean": masked_mean(weight, mask),
        "off_policy/weight_max": weight[valid].max() if valid.any() else no_token,
        "off_policy/ratio_max": torch.exp(log_ratio[valid].max().clamp(max=SAFETY_BOUND)) if valid.any() else no_token,
        AFFECTED_METRIC[params.mode]: masked_mean(affected.float(), mask),
    }
    return weight, metrics

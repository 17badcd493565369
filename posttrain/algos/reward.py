"""Reward-model losses on scalar scores of preference pairs (pure functions)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, *, margin: Tensor | None = None, center_coefficient: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry pairwise loss (Ouyang et al. 2022, eq. 1): mean_i -log sigmoid(r_w - r_l - m_i).

    chosen_rewards, rejected_rewards: (B,); margin: optional (B,) per-pair margin (Llama 2's variant);
    center_coefficient > 0 adds c * mean((r_w + r_l)^2), pulling scores toward zero mean
    (Eisenstein et al. 2023; TRL's `center_rewards_coefficient`). Metrics: accuracy (share of pairs
    with r_w > r_l), margin (mean r_w - r_l), chosen / rejected (mean rewards).
    """
    diff = chosen_rewards - rejected_rewards  # (B,)
    loss = -F.logsigmoid(diff if margin is None else diff - margin).mean()
    if center_coefficient:
        loss = loss + center_coefficient * (chosen_rewards + rejected_rewards).square().mean()
    diff = diff.detach()
    return loss, {
        "accuracy": (diff > 0).to(diff.dtype).mean(),
        "margin": diff.mean(),
        "rewards/chosen": chosen_rewards.detach().mean(),
        "rewards/rejected": rejected_rewards.detach().mean(),
    }

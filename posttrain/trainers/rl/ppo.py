"""PPO's pieces: the value head and the GAE advantages (`train.train_ppo` runs the shared RL loop with them).

The critic is a value head, `Linear(d, 1)`, on the POLICY's final hidden states (the same trunk, the
same forward pass): one extra matrix-vector product per token instead of a second model, which is
what makes PPO affordable next to the engine on one device. The cost is that value gradients flow
into the trunk the policy uses; `ppo.vf_coef` weighs them, and the head gets its own (higher)
learning rate because it starts from zero. verl / OpenRLHF default to a separate critic model;
a separate critic would double the training forward and the optimizer state.

V(s_t) is read at the state that predicts completion token t, the same state whose logits give
log pi(y_t | s_t). Token rewards: the outcome reward on the last token, minus beta * KL per token
when `kl.in_reward` (the classic RLHF shaping); then GAE(gamma, lam), advantages whitened over the
batch (optional), returns = advantages + values as the value targets. On multi-turn episodes (`env:`) the
"tokens" are the model's: the outcome sits on the episode's last model token, GAE skips the observation
tokens between turns, and with env.turn_rewards=per_turn each environment step's reward sits on the last
model token of the turn that earned it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from posttrain.algos import ADVANTAGE_ESTIMATORS, masked_whiten
from posttrain.algos.advantages import outcome_token_rewards
from posttrain.distributed.env import all_reduce_sum

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(nn.Module):
    """(..., d) hidden states -> (..., 1) values; zero-initialised so V starts at 0 for every state."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, dtype=dtype, device=device)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.proj(hidden)


@torch.no_grad()
def ppo_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool,
    per_token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    turn_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE over token rewards built from outcome rewards.

    rewards (B,) outcome scores, NaN = unscorable (those rows are dropped from `mask` by the caller);
    values, mask, per_token_kl, turn_rewards (B, L). The outcome sits on each row's last masked-in token: in an
    episode (mask 0 on the observations between turns) the last MODEL token, and GAE steps over model tokens
    only, carrying value and advantage across the observations. `turn_rewards`: an episode's per-turn rewards,
    each on the last model token of its turn (env.turn_rewards=per_turn). Returns (advantages, returns), (B, L),
    zero outside the mask.
    """
    mask = mask.float()
    token_rewards = outcome_token_rewards(
        rewards, mask, turn_rewards=turn_rewards, per_token_kl=per_token_kl, kl_coef=kl_coef
    )  # (B, L)
    advantages, returns = ADVANTAGE_ESTIMATORS["gae"](token_rewards, values, mask, gamma=gamma, lam=lam)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


@torch.no_grad()
def whiten_over_ranks(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """`masked_whiten` with the mean and the (unbiased) variance taken over every rank's masked entries, so a
    data-parallel batch is whitened as the whole batch would be in one process. values, mask (B, L)."""
    mask = mask.float()
    sums = all_reduce_sum(torch.stack([(values.double() * mask).sum(), mask.double().sum()]))  # (2,): sum, count
    total, count = float(sums[0]), float(sums[1])
    if count < 2:
        return torch.zeros_like(values)
    centered = values - total / count
    var = float(all_reduce_sum((centered.double() ** 2 * mask).sum())) / (count - 1)
    whitened = centered * (var + eps) ** -0.5
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def save_value_head(head: ValueHead, directory: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(directory) / VALUE_HEAD_FILE
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(path))
    return path

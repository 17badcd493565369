"""Advantage estimators: rewards (and, for PPO, values) in, advantages out.

Group layout. Group estimators take rewards (B,) with B = num_prompts * G, where rows
[g*G, (g+1)*G) are the G completions sampled for prompt g (TRL's `repeat_interleave` layout).

Unscorable samples. A NaN reward marks a completion that no reward function could score. It is left
out of every statistic (group mean and std, the leave-one-out baseline, batch whitening) and gets
advantage 0, so it neither moves the policy nor biases the baseline of its siblings. This is what
TRL v1.16 does (GRPOTrainer / RLOOTrainer: nan-aware statistics, then `nan_to_num(0)`).

No baseline, no signal. A group with fewer than two scorable rewards (G == 1 included) has no
group baseline and an undefined std, so every advantage in it is 0. TRL gives 0 there as well;
verl instead uses mean 0 and std 1, i.e. passes the raw reward through as the advantage.

Advantages are constants in the policy loss, so every estimator runs under no_grad.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algos.masked import masked_whiten


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """(B,) -> (B // G, G), checking that the batch is whole groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a whole number of groups of {group_size}")
    return rewards.float().reshape(-1, group_size)  # (N, G)


def _group_counts(grouped: Tensor) -> tuple[Tensor, Tensor]:
    """Which rewards are scorable (N, G) and how many per group (N, 1)."""
    scorable = ~torch.isnan(grouped)  # (N, G)
    return scorable, scorable.sum(dim=1, keepdim=True)  # (N, G), (N, 1)


def _zero_where_no_signal(advantages: Tensor, scorable: Tensor, count: Tensor) -> Tensor:
    """Advantage 0 for unscorable rows and for groups with < 2 scorable rewards; flatten to (B,)."""
    has_signal = scorable & (count >= 2)  # (N, G)
    return torch.where(has_signal, advantages, torch.zeros_like(advantages)).reshape(-1)  # (B,)


@torch.no_grad()
def grpo_advantages(rewards: Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO outcome advantages: A_i = (r_i - mean_group(r)) / (std_group(r) + eps).

    DeepSeekMath (Shao et al. 2024, arXiv:2402.03300) section 4.1.2. std is the unbiased (Bessel) one,
    as in TRL (`nanstd`) and verl (`torch.std`). eps = 1e-4 as TRL (verl uses 1e-6); it only matters
    when a group's rewards are (nearly) equal, and then the advantage is ~0 rather than NaN.
    scale_by_std=False gives Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = r_i - mean_group(r).

    rewards: (B,) with NaN for unscorable samples. Returns (B,) float32.
    """
    grouped = _grouped(rewards, group_size)  # (N, G)
    scorable, count = _group_counts(grouped)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # (N, 1); NaN only for all-unscorable groups
    centered = grouped - mean  # (N, G)
    if scale_by_std:
        sq_dev = torch.where(scorable, centered**2, torch.zeros_like(centered))
        std = (sq_dev.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (N, 1)
        centered = centered / (std + eps)
    return _zero_where_no_signal(centered, scorable, count)


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO advantages: A_i = r_i - mean_group(r), no std scaling (arXiv:2503.20783, eq. 3).

    Pair with the `seq-mean-token-sum-norm` aggregation to get the full Dr.GRPO objective.
    rewards: (B,) with NaN for unscorable samples. Returns (B,) float32.
    """
    return grpo_advantages(rewards, group_size, scale_by_std=False)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: A_i = r_i - mean_{j != i, j scorable}(r_j), the leave-one-out baseline.

    Kool et al. 2019 "Buy 4 REINFORCE samples, get a baseline for free"; Ahmadian et al. 2024
    (arXiv:2402.14740). Equal to n/(n-1) * (r_i - mean(r)) over the n scorable rewards of the group,
    which is verl's form; TRL's form (sum - r_i) / (n - 1) is used here.

    rewards: (B,) with NaN for unscorable samples. Returns (B,) float32.
    """
    grouped = _grouped(rewards, group_size)  # (N, G)
    scorable, count = _group_counts(grouped)
    total = torch.nansum(grouped, dim=1, keepdim=True)  # (N, 1)
    baseline = (total - grouped) / (count - 1).clamp(min=1)  # (N, G); mean of the scorable others
    return _zero_where_no_signal(grouped - baseline, scorable, count)


@torch.no_grad()
def outcome_token_rewards(
    scores: Tensor,
    mask: Tensor,
    *,
    turn_rewards: Tensor | None = None,
    per_token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Token rewards of the token-level estimators: each row's outcome score on its LAST valid position (in a
    multi-turn episode the last model token, never an observation after it), plus per-token rewards placed by the
    caller (an episode's per-turn rewards on each turn's last model token), minus kl_coef * KL per valid token.

    scores (B,) with NaN = unscorable (placed as 0); mask, turn_rewards, per_token_kl (B, T). Returns (B, T)
    float32, zero outside the mask.
    """
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"scores (B,) and mask (B, T) disagree: {tuple(scores.shape)} vs {tuple(mask.shape)}")
    mask = mask.float()  # (B, T)
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)  # (B,) last valid position
    token_rewards = torch.zeros_like(mask)  # (B, T)
    token_rewards[torch.arange(mask.shape[0]), last] = torch.nan_to_num(scores.float()) * mask.amax(dim=1)
    if turn_rewards is not None:
        token_rewards = token_rewards + turn_rewards.float() * mask
    if per_token_kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * per_token_kl.float() * mask
    return token_rewards


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    per_token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    turn_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): KL-shaped token rewards, returns-to-go, batch whitening.

    Follows verl's `compute_reinforce_plus_plus_outcome_advantage` with `use_kl_in_reward`
    (verl/trainer/ppo/core_algos.py and `apply_kl_penalty` in ray_trainer.py):
        token reward  r_t = score * [t is the last response token] - kl_coef * kl_t  (`outcome_token_rewards`)
        return        G_t = r_t + gamma * G_{t'}     (t' = the next valid position; 0 past the end)
        advantage     A_t = whiten(G_t) over all valid tokens of the batch (unbiased var, eps 1e-8)
    Masked positions are skipped, not steps: the return is carried across them unchanged, so the observation
    tokens between an episode's turns neither cut nor discount it (verl restarts the return at a masked position,
    which for a multi-turn response would leave every turn before the last without the outcome). For a single
    turn, whose masked positions all trail the response, the two agree. `per_token_kl` is the k1 estimate
    (log pi_old - log pi_ref) in verl's default; pass any `KL_ESTIMATORS` output. `turn_rewards` (B, T): rewards
    on chosen tokens (an episode's per-turn rewards). Unscorable rows (NaN score) are left out of the whitening
    statistics and get advantage 0. Fewer than two valid tokens in the batch -> all zeros.

    rewards: (B,) outcome scores; mask: (B, T) response tokens. Returns (advantages, returns), (B, T).
    """
    if mask.dim() != 2 or rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards (B,) and mask (B, T) disagree: {tuple(rewards.shape)} vs {tuple(mask.shape)}")
    mask = mask.float()  # (B, T)
    scorable = ~torch.isnan(rewards)  # (B,)
    token_rewards = outcome_token_rewards(
        rewards, mask, turn_rewards=turn_rewards, per_token_kl=per_token_kl, kl_coef=kl_coef
    )  # (B, T)

    returns = torch.zeros_like(token_rewards)  # (B, T)
    running = torch.zeros_like(token_rewards[:, 0])  # (B,) G at the next valid position
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t]
        running = valid * (token_rewards[:, t] + gamma * running) + (1 - valid) * running
        returns[:, t] = running

    stats_mask = mask * scorable.unsqueeze(1)  # (B, T)
    return masked_whiten(returns, stats_mask), returns * mask


@torch.no_grad()
def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438) for PPO.

        delta_t = r_t + gamma * V_{t'} - V_t            (t' = next valid position; V = 0 past the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                              (the value target)
    Masked positions are skipped, not treated as steps: value and advantage are carried across them
    (verl's `compute_gae_advantage_return`, which handles tool-output tokens inside a response).
    Unlike verl and TRL this does not whiten: call `masked_whiten(advantages, mask)` for that.

    rewards, values, mask: (B, T). Returns (advantages, returns), (B, T), zero outside the mask.
    """
    mask = mask.float()  # (B, T)
    rewards, values = rewards.float(), values.float().detach()
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_adv = torch.zeros_like(values[:, 0])  # (B,)
    advantages = torch.zeros_like(values)  # (B, T)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        valid = mask[:, t]
        next_value = valid * values[:, t] + (1 - valid) * next_value
        next_adv = valid * adv_t + (1 - valid) * next_adv
        advantages[:, t] = adv_t * valid
    return advantages, (advantages + values) * mask


@torch.no_grad()
def dapo_dynamic_sampling_mask(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, eq. 11): keep groups whose rewards differ.

    The paper keeps a group when 0 < #correct < G: pass the task (correctness) rewards, before any
    shaping such as the soft overlong penalty, or an all-wrong group whose lengths differ is kept and
    trains on length alone. A group where every scorable task reward is equal (all correct, all wrong)
    carries no correctness signal and only dilutes the batch. Groups with fewer than two scorable
    rewards are dropped too (no baseline, see the module note); verl keeps singleton groups because it
    passes their raw reward through. Equality is exact (max == min), as verl's std > 0.

    rewards: (B,) with NaN for unscorable. Returns (B,) bool: True for every row of a kept group.
    """
    grouped = _grouped(rewards, group_size)  # (N, G)
    scorable, count = _group_counts(grouped)
    high = torch.where(scorable, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)  # (N,)
    low = torch.where(scorable, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)  # (N,)
    keep = (count.squeeze(1) >= 2) & (high > low)  # (N,)
    return keep.repeat_interleave(group_size)  # (B,)


def soft_overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, *, penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), added to the task reward.

        0                                         if |y| <= max_len - cache_len
        ((max_len - cache_len) - |y|) / cache_len  if max_len - cache_len < |y| <= max_len
        -1                                        if |y| > max_len
    times `penalty_factor` (verl's `overlong_penalty_factor`). verl omits the -1 floor because its
    responses never exceed max_len; the paper's floor is kept here.

    lengths: (B,) response lengths in tokens. Returns (B,) float32 penalties in [-penalty_factor, 0].
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    expected = max_len - cache_len
    penalty = (expected - lengths.float()) / cache_len  # (B,)
    return penalty.clamp(min=-1.0, max=0.0) * penalty_factor


# Outcome estimators take (rewards (B,), group_size) -> (B,); token-level ones (reinforce_pp, gae)
# take (B, T) tensors and return (advantages, returns). Each docstring gives its exact contract.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "gae": gae_advantages,
}

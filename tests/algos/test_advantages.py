"""Advantage estimators against plain-Python loops written from the papers' formulas."""

import math
import statistics

import pytest
import torch

from posttrain.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    dapo_dynamic_sampling_mask,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    soft_overlong_penalty,
)

NAN = float("nan")


def _groups(rewards: list[float], g: int) -> list[list[float]]:
    return [rewards[i : i + g] for i in range(0, len(rewards), g)]


def reference_grpo(rewards: list[float], g: int, scale: bool, eps: float) -> list[float]:
    out = []
    for group in _groups(rewards, g):
        scored = [r for r in group if not math.isnan(r)]
        for r in group:
            if math.isnan(r) or len(scored) < 2:
                out.append(0.0)
                continue
            a = r - statistics.fmean(scored)
            out.append(a / (statistics.stdev(scored) + eps) if scale else a)
    return out


def reference_rloo(rewards: list[float], g: int) -> list[float]:
    out = []
    for group in _groups(rewards, g):
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i and not math.isnan(x)]
            out.append(0.0 if math.isnan(r) or not others else r - statistics.fmean(others))
    return out


REWARDS = [1.0, 0.0, 0.5, 0.25, 3.0, NAN, 1.0, 2.0, NAN, NAN, NAN, NAN, 7.0, NAN, NAN, NAN]


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_matches_loop_with_unscorable(scale: bool) -> None:
    got = grpo_advantages(torch.tensor(REWARDS), 4, scale_by_std=scale, eps=1e-4)
    want = reference_grpo(REWARDS, 4, scale, 1e-4)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)


def test_dr_grpo_matches_loop_with_unscorable() -> None:
    # A_i = r_i - mean of the group's scorable rewards (no std); unscorable rows and groups with < 2 scorable get 0
    got = dr_grpo_advantages(torch.tensor(REWARDS), 4)
    want = reference_grpo(REWARDS, 4, scale=False, eps=0.0)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)
    # the first two groups by hand: means 0.4375 and 2.0 (over the three scorable rewards)
    assert got[:8].tolist() == [0.5625, -0.4375, 0.0625, -0.1875, 1.0, 0.0, -1.0, 0.0]


def test_rloo_matches_loop_with_unscorable() -> None:
    got = rloo_advantages(torch.tensor(REWARDS), 4)
    torch.testing.assert_close(got, torch.tensor(reference_rloo(REWARDS, 4)), atol=1e-6, rtol=1e-6)


def test_rloo_equals_scaled_grpo_centering() -> None:
    # r_i - mean_{j != i} r_j == n / (n - 1) * (r_i - mean r): verl's form of the same baseline
    r = torch.randn(24, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rloo_advantages(r, 6), 6 / 5 * dr_grpo_advantages(r, 6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_unscorable_rows_get_zero_and_do_not_move_siblings(name: str) -> None:
    fn = ADVANTAGE_ESTIMATORS[name]
    with_nan = fn(torch.tensor([1.0, NAN, 0.0, 2.0]), 4)
    without = fn(torch.tensor([1.0, 0.0, 2.0]), 3)
    assert with_nan[1] == 0.0
    torch.testing.assert_close(with_nan[[0, 2, 3]], without)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_of_size_one_gets_zero(name: str) -> None:
    # std and the leave-one-out baseline are undefined for one sample: no signal, documented as 0
    out = ADVANTAGE_ESTIMATORS[name](torch.tensor([3.0, -1.0, 0.5]), 1)
    assert torch.equal(out, torch.zeros(3))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_all_equal_rewards_give_zero_not_nan(name: str) -> None:
    out = ADVANTAGE_ESTIMATORS[name](torch.full((8,), 0.1), 4)
    assert not out.isnan().any()
    assert out.abs().max() < 1e-5


def test_bad_group_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.zeros(8), 3)


def reference_reinforce_pp(
    scores: list[float], mask: list[list[int]], gamma: float, kl: list[list[float]], kl_coef: float
) -> list[list[float]]:
    """REINFORCE++ written out: token rewards, discounted return-to-go, whitening over valid tokens."""
    all_returns = []
    for score, row_mask, row_kl in zip(scores, mask, kl, strict=True):
        valid = [t for t, m in enumerate(row_mask) if m]
        rewards = [-kl_coef * row_kl[t] if row_mask[t] else 0.0 for t in range(len(row_mask))]
        rewards[valid[-1]] += 0.0 if math.isnan(score) else score
        returns, running = [0.0] * len(row_mask), 0.0
        for t in reversed(range(len(row_mask))):
            running = rewards[t] + gamma * running
            returns[t] = running
        all_returns.append(returns)
    pool = [
        all_returns[i][t]
        for i, row_mask in enumerate(mask)
        for t, m in enumerate(row_mask)
        if m and not math.isnan(scores[i])
    ]
    mean, var = statistics.fmean(pool), statistics.variance(pool)
    return [
        [
            (all_returns[i][t] - mean) / math.sqrt(var + 1e-8) if m and not math.isnan(scores[i]) else 0.0
            for t, m in enumerate(row_mask)
        ]
        for i, row_mask in enumerate(mask)
    ]


@pytest.mark.parametrize("gamma, kl_coef", [(1.0, 0.0), (0.9, 0.05)])
def test_reinforce_pp_matches_loop(gamma: float, kl_coef: float) -> None:
    gen = torch.Generator().manual_seed(1)
    scores = [1.0, 0.0, NAN, 0.5, 2.0]
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    )
    kl = torch.rand(5, 6, generator=gen)
    adv, returns = reinforce_pp_advantages(torch.tensor(scores), mask, gamma=gamma, per_token_kl=kl, kl_coef=kl_coef)
    want = reference_reinforce_pp(scores, mask.tolist(), gamma, kl.tolist(), kl_coef)
    torch.testing.assert_close(adv, torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert returns[1, 0].item() == pytest.approx(sum(-kl_coef * kl[1, t].item() * gamma**t for t in range(3)) + 0.0)


def test_reinforce_pp_all_equal_scores_is_zero() -> None:
    adv, _ = reinforce_pp_advantages(torch.full((4,), 0.1), torch.ones(4, 7))
    assert not adv.isnan().any()
    assert adv.abs().max() < 1e-3


def reference_gae(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """GAE over the valid positions only (masked ones are not time steps)."""
    steps = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    next_value, next_adv = 0.0, 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[t]
        adv[t] = next_adv
    returns = [a + v if m else 0.0 for a, v, m in zip(adv, values, mask, strict=True)]
    return adv, returns


def test_gae_matches_loop_including_holes_in_the_mask() -> None:
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 1, 1, 0]])  # row 2: tool output
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    for i in range(3):
        want_adv, want_ret = reference_gae(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), 0.95, 0.9)
        torch.testing.assert_close(adv[i], torch.tensor(want_adv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[i], torch.tensor(want_ret), atol=1e-5, rtol=1e-5)


def test_gae_lambda_one_gamma_one_is_return_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.7]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3))
    torch.testing.assert_close(ret, torch.ones(1, 3))
    torch.testing.assert_close(adv, 1.0 - values)


def test_dapo_dynamic_sampling_keeps_groups_with_different_rewards() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, NAN, NAN, NAN, 1.0, NAN, 0.0, NAN])
    keep = dapo_dynamic_sampling_mask(rewards, 4)
    assert keep.tolist() == [True] * 4 + [False] * 4 + [False] * 4 + [True] * 4


def test_soft_overlong_penalty_piecewise() -> None:
    lengths = torch.tensor([0, 80, 81, 90, 100, 101, 500])
    got = soft_overlong_penalty(lengths, max_len=100, cache_len=20, penalty_factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]))
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 20, penalty_factor=0.5), 0.5 * got)

"""Off-policy (IS) weights against verl's and TRL's definitions, restated here by hand on identical tensors.

verl (verl/trainer/ppo/rollout_corr_helper.py): log_ratio = old - rollout;
  - rollout_is (truncated): token: exp(clamp(log_ratio, +-20)); sequence: exp(clamp(masked_sum(log_ratio), +-20))
    broadcast; times the response mask; clamp(max=rollout_is_threshold).
  - rollout_rs (rejection): the same weights, kept where lower <= w <= upper (lower defaults to 1 / upper); the
    response mask becomes response_mask * kept; rollout_rs_masked_fraction = masked_mean(1 - kept, response_mask).
TRL (trl/trainer/grpo_trainer.py, vllm_importance_sampling_mode): diff = nan_to_num((old - sampling) * mask);
  sequence_*: diff.sum(-1, keepdim); ratio = exp(diff); *_truncate: clamp(ratio, clip_min, clip_max);
  *_mask: ratio.masked_fill((ratio < clip_min) | (ratio > clip_max), 0).
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algos.importance import OffPolicyParams, off_policy_weights

B, T = 6, 9
SAFETY = 20.0


def tensors(spread: float = 0.25, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3
    behaviour = old + spread * torch.randn(B, T, generator=gen)
    mask = (torch.arange(T) < torch.randint(2, T + 1, (B, 1), generator=gen)).float()
    return old, behaviour, mask


def verl_masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(dim=-1)


def verl_weights(old, rollout, mask, level: str) -> torch.Tensor:
    log_ratio = old - rollout
    if level == "token":
        return torch.exp(torch.clamp(log_ratio, min=-SAFETY, max=SAFETY))
    log_ratio_sum = verl_masked_sum(log_ratio, mask).unsqueeze(-1)
    return torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY, max=SAFETY)).expand_as(log_ratio)


def verl_rollout_is(old, rollout, mask, level: str, threshold: float) -> torch.Tensor:
    return (verl_weights(old, rollout, mask, level) * mask).clamp(max=threshold)


def verl_rollout_rs(old, rollout, mask, level: str, upper: float, lower: float | None) -> tuple[torch.Tensor, float]:
    lower = 1.0 / upper if lower is None else lower
    w = verl_weights(old, rollout, mask, level)
    kept = ((w >= lower) & (w <= upper)).float()
    masked_fraction = float(((1 - kept) * mask).sum() / mask.sum())
    return mask * kept, masked_fraction


def trl_ratio(old, sampling, mask, mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -float("inf")
    high = clip_max if clip_max is not None else float("inf")
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_is_verls_and_trls(level):
    old, behaviour, mask = tensors()
    cap = 1.15
    ours, metrics = off_policy_weights(old, behaviour, mask, OffPolicyParams("tis", level, cap=cap))
    torch.testing.assert_close(ours, verl_rollout_is(old, behaviour, mask, level, cap))
    trl = trl_ratio(old, behaviour, mask, f"{level}_truncate", None, cap).expand(B, T) * mask
    torch.testing.assert_close(ours, trl)
    truncated = (ours == cap) & mask.bool()
    assert truncated.any() and ((ours < 1) & mask.bool()).any()  # the cap bites, and not everywhere
    assert float(metrics["off_policy/truncated_frac"]) == pytest.approx(float(truncated.sum() / mask.sum()))
    assert float(metrics["off_policy/weight_max"]) == pytest.approx(cap)
    assert float(metrics["off_policy/weight_mean"]) == pytest.approx(float(ours.sum() / mask.sum()))
    assert float(metrics["off_policy/ratio_max"]) > cap


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("low", [None, 0.7])
def test_masked_is_keeps_what_verl_and_trl_keep(level, low):
    old, behaviour, mask = tensors()
    high = 1.3
    ours, metrics = off_policy_weights(old, behaviour, mask, OffPolicyParams("mis", level, low=low, high=high))
    kept_mask, masked_fraction = verl_rollout_rs(old, behaviour, mask, level, high, low)
    torch.testing.assert_close(ours, kept_mask)  # 1 where verl keeps the token in its response mask, else 0
    assert float(metrics["off_policy/masked_frac"]) == pytest.approx(masked_fraction)
    assert 0 < masked_fraction < 1
    # TRL's *_mask zeroes the same tokens (and keeps the ratio as the weight of the others).
    trl = trl_ratio(old, behaviour, mask, f"{level}_mask", 1 / high if low is None else low, high).expand(B, T)
    torch.testing.assert_close(ours, ((trl != 0) & mask.bool()).float())


def test_a_long_sequence_never_overflows():
    old, behaviour, mask = tensors()
    behaviour = behaviour.clone()
    behaviour[0] -= 30.0  # log ratio +30 per token: a product of e^(30 T)
    behaviour[1] += 30.0
    tis, metrics = off_policy_weights(old, behaviour, mask, OffPolicyParams("tis", "sequence", cap=2.0))
    assert torch.isfinite(tis).all() and (tis[0][mask[0].bool()] == 2.0).all()
    assert torch.isfinite(metrics["off_policy/ratio_max"])
    assert (tis[1][mask[1].bool()] < 1e-8).all()
    mis, _ = off_policy_weights(old, behaviour, mask, OffPolicyParams("mis", "sequence", high=2.0))
    assert (mis[:2] == 0).all()


def test_padding_is_ignored_even_when_it_holds_nan():
    old, behaviour, mask = tensors()
    dirty = behaviour.masked_fill(~mask.bool(), float("nan"))
    for params in (OffPolicyParams("tis", "sequence", cap=1.1), OffPolicyParams("mis", "token")):
        clean_w, clean_m = off_policy_weights(old, behaviour, mask, params)
        dirty_w, dirty_m = off_policy_weights(old, dirty, mask, params)
        torch.testing.assert_close(dirty_w, clean_w)
        assert (dirty_w[~mask.bool()] == 0).all()
        for key in clean_m:
            torch.testing.assert_close(dirty_m[key], clean_m[key])


def test_weights_carry_no_gradient():
    old, behaviour, mask = tensors()
    old = old.clone().requires_grad_()
    weight, _ = off_policy_weights(old, behaviour, mask, OffPolicyParams("tis"))
    assert not weight.requires_grad


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "clip"}, "mode 'clip'"),
        ({"mode": "tis", "level": "geometric"}, "level 'geometric'"),
        ({"mode": "tis", "cap": 0.0}, "cap must be > 0"),
        ({"mode": "mis", "low": 2.0, "high": 1.5}, "low <= high"),
    ],
)
def test_bad_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffPolicyParams(**kwargs)

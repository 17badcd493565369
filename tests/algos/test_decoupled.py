"""AReaL's decoupled PPO objective against its formula as AReaL documents it (arXiv:2505.24298 eq. 5; the
`ppo_actor_loss_fn` of areal/utils/functional with use_decoupled_loss), restated here by hand on identical tensors:

    ratio      = exp(logp - prox)                    (masked)
    pg_loss    = max(-A * ratio, -A * clamp(ratio, 1 - eps, 1 + eps_higher))
    pg_loss    = min(pg_loss, sign(A) * c * A)       with c_clip (dual clip)
    behav_w    = exp(prox - behav), set to 0 where behav_w > behav_imp_weight_cap (and outside the mask)
    loss       = sum(mask * pg_loss * behav_w) / count(mask)

posttrain states it twice: `decoupled_ppo_loss` on its own, and `rl_objective` with off_policy mode decoupled and
pi_old = pi_prox (what the trainer runs); both must give AReaL's loss and gradient.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algos.decoupled import decoupled_ppo_loss
from posttrain.algos.importance import OffPolicyParams
from posttrain.algos.objective import ObjectiveParams, rl_objective

B, T = 5, 7


def areal_loss(logp, prox, behav, adv, mask, eps, eps_higher, c_clip, cap) -> torch.Tensor:
    valid = mask.bool()
    adv = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv
    ratio = torch.where(valid, torch.exp(logp - prox), torch.zeros_like(logp))
    clipped = torch.clamp(ratio, 1.0 - eps, 1.0 + eps_higher)
    pg = torch.max(-adv * ratio, -adv * clipped)
    if c_clip is not None:
        pg = torch.min(pg, torch.sign(adv) * c_clip * adv)
    w = torch.exp(prox - behav)
    keep = valid if cap is None else (w <= cap) & valid
    w = torch.where(keep, w, torch.zeros_like(w))
    return torch.where(valid, pg * w, torch.zeros_like(pg)).sum() / valid.sum()


def tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=gen) * 3
    logp = (prox + 0.3 * torch.randn(B, T, generator=gen)).requires_grad_(True)
    behav = prox + 0.8 * torch.randn(B, T, generator=gen)  # stale: far enough that some weights pass a cap of 2
    adv = torch.randn(B, generator=gen)
    mask = (torch.arange(T) < torch.randint(2, T + 1, (B, 1), generator=gen)).float()
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize(
    "eps_low, eps_high, dual_clip, cap",
    [(0.2, 0.2, None, None), (0.2, 0.28, None, 2.0), (0.2, 0.2, 3.0, 2.0), (0.1, 0.3, 3.0, 1.5)],
)
def test_decoupled_loss_is_areals(eps_low: float, eps_high: float, dual_clip: float | None, cap: float | None) -> None:
    logp, prox, behav, adv, mask = tensors(0)
    expected = areal_loss(logp, prox, behav, adv, mask, eps_low, eps_high, dual_clip, cap)
    (expected_grad,) = torch.autograd.grad(expected, logp)

    per_token, metrics = decoupled_ppo_loss(
        logp,
        prox,
        behav,
        adv,
        mask,
        clip_eps_low=eps_low,
        clip_eps_high=eps_high,
        dual_clip=dual_clip,
        behaviour_cap=cap,
    )
    ours = per_token.sum() / mask.sum()
    (grad,) = torch.autograd.grad(ours, logp)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)
    if cap is not None:  # the test's tensors do cross the cap: the masking is exercised
        w = torch.exp(prox - behav)
        assert float(metrics["off_policy/masked_frac"]) == pytest.approx(
            float(((w > cap).float() * mask).sum() / mask.sum())
        )
        assert float(metrics["off_policy/masked_frac"]) > 0

    # The trainer's path: rl_objective with pi_old = pi_prox and the decoupled correction, token-mean.
    params = ObjectiveParams(
        policy_loss="dapo",
        aggregation="token-mean",
        max_len=T,
        loss_params={"clip_eps_low": eps_low, "clip_eps_high": eps_high, "dual_clip": dual_clip},
        off_policy=OffPolicyParams("decoupled", "token", cap=cap if cap is not None else float("inf")),
    )
    objective = rl_objective(logp, adv, mask, params, old_logprobs=prox, rollout_logprobs=behav)
    (trainer_grad,) = torch.autograd.grad(objective.policy.mean(), logp)
    torch.testing.assert_close(objective.policy.mean(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(trainer_grad, expected_grad, rtol=1e-6, atol=1e-7)


def test_on_policy_decoupled_is_ppo_clip() -> None:
    logp, prox, _, adv, mask = tensors(1)
    per_token, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    ratio = torch.exp(logp - prox)
    a = adv.unsqueeze(-1)
    ppo = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * mask
    torch.testing.assert_close(per_token, ppo, rtol=1e-6, atol=1e-7)


def test_decoupled_refuses_sequence_level() -> None:
    with pytest.raises(ValueError, match="level must be token"):
        OffPolicyParams("decoupled", "sequence")

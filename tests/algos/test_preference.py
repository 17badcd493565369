"""Preference losses on hand-computed cases and the properties their papers state."""

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.algos.preference import (
    PREFERENCE_LOSSES,
    _log1mexp,
    cdpo_loss,
    dpo_sigmoid_loss,
    hinge_loss,
    ipo_loss,
    kto_loss,
    orpo_loss,
    robust_dpo_loss,
    simpo_loss,
)

GEN = torch.Generator().manual_seed(0)
PC, PR, RC, RR = (-torch.rand(6, generator=GEN, dtype=torch.float64) * 40 for _ in range(4))
LC = torch.tensor([5.0, 9, 12, 3, 7, 20], dtype=torch.float64)  # response lengths
LR = torch.tensor([8.0, 4, 12, 6, 2, 15], dtype=torch.float64)
DELTA = (PC - RC) - (PR - RR)


def test_dpo_sigmoid_formula_and_metrics() -> None:
    loss, m = dpo_sigmoid_loss(PC, PR, RC, RR, beta=0.1)
    torch.testing.assert_close(loss, -F.logsigmoid(0.1 * DELTA).mean())
    torch.testing.assert_close(m["rewards/chosen"], (0.1 * (PC - RC)).mean())
    torch.testing.assert_close(m["rewards/margins"], (0.1 * DELTA).mean())
    torch.testing.assert_close(m["rewards/accuracies"], (DELTA > 0).double().mean())
    torch.testing.assert_close(m["logps/rejected"], PR.mean())


def test_dpo_at_the_reference_is_log_two() -> None:
    zeros = torch.zeros(3)
    loss, m = dpo_sigmoid_loss(zeros - 5, zeros - 7, zeros - 5, zeros - 7)
    assert loss.item() == pytest.approx(math.log(2))
    assert m["rewards/accuracies"] == 0.0  # ties are not counted as correct


def test_label_smoothing_zero_reduces_to_dpo() -> None:
    dpo, _ = dpo_sigmoid_loss(PC, PR, RC, RR, beta=0.2)
    for fn in (cdpo_loss, robust_dpo_loss):
        torch.testing.assert_close(fn(PC, PR, RC, RR, beta=0.2, label_smoothing=0.0)[0], dpo)


def test_cdpo_is_dpo_against_soft_labels() -> None:
    eps, beta = 0.15, 0.1
    loss, _ = cdpo_loss(PC, PR, RC, RR, beta=beta, label_smoothing=eps)
    soft_bce = F.binary_cross_entropy_with_logits(beta * DELTA, torch.full_like(DELTA, 1 - eps))
    torch.testing.assert_close(loss, soft_bce)


def test_robust_dpo_is_unbiased_under_label_flips() -> None:
    # rDPO's defining property: (1 - eps) l(Delta) + eps l(-Delta) equals the clean DPO loss
    eps, beta = 0.2, 0.1
    forward, _ = robust_dpo_loss(PC, PR, RC, RR, beta=beta, label_smoothing=eps)
    flipped, _ = robust_dpo_loss(PR, PC, RR, RC, beta=beta, label_smoothing=eps)
    clean, _ = dpo_sigmoid_loss(PC, PR, RC, RR, beta=beta)
    torch.testing.assert_close((1 - eps) * forward + eps * flipped, clean)


def test_label_smoothing_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="label_smoothing"):
        robust_dpo_loss(PC, PR, RC, RR, label_smoothing=0.5)


def test_hinge_and_ipo_formulas() -> None:
    torch.testing.assert_close(hinge_loss(PC, PR, RC, RR, beta=0.1)[0], torch.relu(1 - 0.1 * DELTA).mean())
    h = (PC - RC) / LC - (PR - RR) / LR
    torch.testing.assert_close(ipo_loss(PC, PR, RC, RR, LC, LR, beta=0.1)[0], ((h - 5.0) ** 2).mean())


def test_simpo_formula() -> None:
    loss, m = simpo_loss(PC, PR, LC, LR, beta=2.0, gamma=0.8)
    want = -F.logsigmoid(2.0 * (PC / LC - PR / LR) - 0.8).mean()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(m["logps/chosen"], (PC / LC).mean())


def test_log1mexp_is_accurate_at_both_ends() -> None:
    x = torch.tensor([-1e-10, -0.1, -0.7, -5.0, -50.0], dtype=torch.float64)
    # float64 reference through expm1 is exact enough; the naive log(1 - exp(x)) loses -1e-10 entirely in fp32
    torch.testing.assert_close(_log1mexp(x), torch.log(-torch.expm1(x)))
    got32 = _log1mexp(x.float())
    assert torch.isfinite(got32).all()
    torch.testing.assert_close(got32.double(), torch.log(-torch.expm1(x)), rtol=1e-6, atol=1e-6)


def test_orpo_formula_and_default_nll() -> None:
    pc, pr = -torch.tensor([3.0, 10.0]), -torch.tensor([6.0, 9.0])
    lc, lr = torch.tensor([3.0, 5.0]), torch.tensor([2.0, 3.0])
    loss, m = orpo_loss(pc, pr, lc, lr, beta=0.5)
    avg_c, avg_r = pc / lc, pr / lr  # [-1, -2], [-3, -3]
    odds = lambda p: math.log(p / (1 - p))  # noqa: E731
    pairs = zip(avg_c.tolist(), avg_r.tolist(), strict=True)
    log_odds = torch.tensor([odds(math.exp(a)) - odds(math.exp(b)) for a, b in pairs])
    nll = 13.0 / 8.0  # token-mean over chosen response tokens
    torch.testing.assert_close(loss, nll - 0.5 * F.logsigmoid(log_odds).mean())
    torch.testing.assert_close(m["log_odds_chosen"], log_odds.mean())
    assert m["nll_loss"].item() == pytest.approx(nll)


def test_kto_formula_with_reference_point() -> None:
    policy = torch.tensor([-10.0, -12.0, -8.0, -20.0])
    ref = torch.tensor([-11.0, -11.0, -9.0, -18.0])
    desirable = torch.tensor([True, False, True, False])
    policy_kl, ref_kl = torch.tensor([-30.0, -31.0]), torch.tensor([-30.5, -31.5])  # z0 = 0.5
    loss, m = kto_loss(
        policy,
        ref,
        desirable,
        policy_kl_logps=policy_kl,
        ref_kl_logps=ref_kl,
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=2.0,
    )
    r = policy - ref  # [1, -1, 1, -2]
    want = torch.stack(
        [
            1 - torch.sigmoid(0.1 * (r[0] - 0.5)),
            2 * (1 - torch.sigmoid(0.1 * (0.5 - r[1]))),
            1 - torch.sigmoid(0.1 * (r[2] - 0.5)),
            2 * (1 - torch.sigmoid(0.1 * (0.5 - r[3]))),
        ]
    ).mean()
    torch.testing.assert_close(loss, want)
    assert m["kl"].item() == pytest.approx(0.5)
    assert m["rewards/chosen"].item() == pytest.approx(0.1)
    assert m["rewards/margins"].item() == pytest.approx(0.1 - (-0.15))


def test_kto_reference_point_is_clamped_at_zero_and_metrics_skip_absent_side() -> None:
    policy, ref, desirable = torch.tensor([-3.0]), torch.tensor([-4.0]), torch.tensor([True])
    loss, m = kto_loss(policy, ref, desirable, policy_kl_logps=torch.tensor([-9.0]), ref_kl_logps=torch.tensor([-5.0]))
    assert m["kl"] == 0.0
    torch.testing.assert_close(loss, 1 - torch.sigmoid(torch.tensor(0.1)))
    assert "rewards/rejected" not in m and "rewards/margins" not in m


def test_gradients_flow_to_policy_logps_only() -> None:
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    loss, metrics = dpo_sigmoid_loss(pc, pr, RC, RR)
    loss.backward()
    assert pc.grad is not None and (pc.grad < 0).all() and (pr.grad > 0).all()  # raise chosen, lower rejected
    assert all(not v.requires_grad for v in metrics.values())


def test_registry_names() -> None:
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "cdpo", "robust", "hinge", "ipo", "simpo", "orpo", "kto"}

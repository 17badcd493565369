"""Policy / value losses and aggregations on hand-computed cases; GSPO against the paper's formula."""

import math

import pytest
import torch

from posttrain.algos.aggregation import AGGREGATIONS
from posttrain.algos.losses import POLICY_LOSSES, dapo_loss, gspo_loss, ppo_clip_loss, value_loss


def _four_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ratio 1.5 / 0.5 with A = +1 / -1: one token in each clip situation."""
    old = torch.zeros(1, 4)
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    return logp, old, adv, torch.ones(1, 4)


def test_ppo_clip_values_gradients_and_metrics() -> None:
    logp, old, adv, mask = _four_cases()
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_eps=0.2)
    # ratio 1.5, A>0: clipped to 1.2 | 0.5, A>0: unclipped | 0.5, A<0: clipped to 0.8 | 1.5, A<0: unclipped
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5]]))
    loss.sum().backward()
    # d(-A r)/d log pi = -A r where unclipped, 0 where the clip is active
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5]]))
    assert metrics["clip_frac/high"].item() == pytest.approx(0.25)
    assert metrics["clip_frac/low"].item() == pytest.approx(0.25)
    assert metrics["ratio/max"].item() == pytest.approx(1.5)
    assert metrics["ratio/mean"].item() == pytest.approx(1.0)
    want_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 0.5, 1.5)) / 4
    assert metrics["approx_kl"].item() == pytest.approx(want_kl, rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    logp = torch.tensor([[math.log(5.0), math.log(5.0)]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_eps=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2]]))


def test_dapo_decouples_clip_range() -> None:
    logp = torch.tensor([[math.log(1.25), math.log(0.75)]])
    adv = torch.tensor([1.0])  # (B,) advantage broadcast over tokens
    loss, metrics = dapo_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_eps_low=0.2, clip_eps_high=0.28)
    # 1.25 < 1.28: not clipped under clip-higher (symmetric 0.2 would clip it to 1.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -0.75]]))
    symmetric, _ = ppo_clip_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_eps=0.2)
    torch.testing.assert_close(symmetric, torch.tensor([[-1.2, -0.75]]))
    assert metrics["clip_frac/high"] == 0.0


def test_loss_is_zero_outside_mask_and_metrics_ignore_padding() -> None:
    logp = torch.tensor([[0.1, 5.0]])
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    assert loss[0, 1] == 0.0
    assert metrics["ratio/max"].item() == pytest.approx(math.exp(0.1))


def paper_gspo(logp, old, adv, mask, eps_low, eps_high) -> torch.Tensor:
    """GSPO eq. (5)-(7) written directly: s_i = exp(mean log ratio), J = mean_i min(s A, clip(s) A)."""
    per_seq = []
    for i in range(logp.shape[0]):
        valid = mask[i].bool()
        s = torch.exp((logp[i][valid] - old[i][valid]).mean())
        per_seq.append(-torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return torch.stack(per_seq).mean()


def test_gspo_matches_paper_formula_in_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    logp0 = old + 0.08 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = (torch.arange(9) < torch.tensor([9, 7, 5, 9, 3, 8]).unsqueeze(1)).double()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3, 2.0, -2.0], dtype=torch.float64)

    logp = logp0.clone().requires_grad_()
    per_token, metrics = gspo_loss(logp, old, adv, mask, clip_eps_low=0.02, clip_eps_high=0.03)
    ours = AGGREGATIONS["seq-mean-token-mean"](per_token, mask)
    ours.backward()

    ref_logp = logp0.clone().requires_grad_()
    ref = paper_gspo(ref_logp, old, adv, mask, 0.02, 0.03)
    ref.backward()

    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, atol=1e-12, rtol=1e-12)
    # the test must exercise both branches
    clipped = metrics["clip_frac/low"] + metrics["clip_frac/high"]
    assert 0 < clipped < 1


def test_value_loss_clipping() -> None:
    values = torch.tensor([[1.0, 1.0]])
    old_values = torch.tensor([[0.5, 0.9]])
    returns = torch.tensor([[2.0, 0.0]])
    loss, metrics = value_loss(values, old_values, returns, torch.ones(1, 2), clip_eps=0.2)
    # token 0: clipped value 0.7 -> (0.7 - 2)^2 = 1.69 > 1 -> 0.845 | token 1: inside the clip range -> 0.5
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.5]]))
    assert metrics["value/clip_frac"].item() == pytest.approx(0.5)


def test_aggregations_on_hand_values() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 is empty
    assert AGGREGATIONS["token-mean"](loss, mask).item() == pytest.approx(10 / 4)
    assert AGGREGATIONS["seq-mean-token-mean"](loss, mask).item() == pytest.approx((2 + 4) / 2)
    assert AGGREGATIONS["seq-mean-token-sum"](loss, mask).item() == pytest.approx((6 + 4) / 2)
    assert AGGREGATIONS["seq-mean-token-sum-norm"](loss, mask, max_len=5).item() == pytest.approx(10 / (3 * 5))
    with pytest.raises(ValueError, match="max_len"):
        AGGREGATIONS["seq-mean-token-sum-norm"](loss, mask)


def test_aggregations_of_an_empty_mask_are_zero() -> None:
    loss, mask = torch.ones(2, 3), torch.zeros(2, 3)
    for name, agg in AGGREGATIONS.items():
        assert agg(loss, mask, max_len=3).item() == 0.0, name


def test_registry_names() -> None:
    assert set(POLICY_LOSSES) == {"ppo_clip", "grpo", "dapo", "gspo"}
    assert set(AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}

"""Schulman's KL estimators: formulas, and exact expectations over a small categorical."""

import torch

from posttrain.algos.kl import KL_ESTIMATORS, k1, k2, k3, low_var_kl


def _two_distributions(vocab: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    return logp, logq


def test_formulas_on_hand_values() -> None:
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(k1(logp, ref), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(k2(logp, ref), torch.tensor([[0.125, 0.5]]))
    log_r = ref - logp
    torch.testing.assert_close(k3(logp, ref), torch.exp(log_r) - 1 - log_r)


def test_k1_and_k3_are_unbiased_for_kl_policy_to_ref() -> None:
    # E_{y ~ pi}[k(y)] over every token of a categorical, weighted by pi: exactly KL(pi || ref)
    logp, logq = _two_distributions()
    true_kl = (logp.exp() * (logp - logq)).sum()
    for estimator in (k1, k3):
        expected = (logp.exp() * estimator(logp, logq)).sum()
        torch.testing.assert_close(expected, true_kl)
    assert (logp.exp() * k2(logp, logq)).sum() != true_kl  # k2 is biased


def test_k2_and_k3_are_non_negative() -> None:
    logp, logq = _two_distributions(50)
    assert (k2(logp, logq) >= 0).all() and (k3(logp, logq) >= 0).all()
    assert (k1(logp, logq) < 0).any()


def test_low_var_kl_equals_k3_in_range_and_clamps_outside() -> None:
    logp = torch.tensor([[-1.0, -30.0, -1.0]])
    ref = torch.tensor([[-1.2, -1.0, -40.0]])
    out = low_var_kl(logp, ref)
    torch.testing.assert_close(out[0, 0], k3(logp, ref)[0, 0])
    assert out[0, 1] == 10.0  # log r = 29 -> clamped to 20 -> exp(20) - 21, clamped to 10
    assert out[0, 2] == 10.0  # log r = -39 -> clamped to -20 -> 19, clamped to 10
    assert k3(logp, ref)[0, 1] > 1e12


def test_registry_names() -> None:
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}

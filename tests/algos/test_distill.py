from __future__ import annotations

import pytest
import torch

from posttrain.algos.distill import DISTILL_LOSSES, forward_kl, generalized_jsd, reverse_kl


def _logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 2, torch.randn(
        2, 5, 11, generator=g, dtype=torch.float64
    ) * 2


def test_kl_against_definition():
    s, t = _logits()
    ps, pt = s.softmax(-1), t.softmax(-1)
    torch.testing.assert_close(forward_kl(s, t), (pt * (pt.log() - ps.log())).sum(-1))
    torch.testing.assert_close(reverse_kl(s, t), (ps * (ps.log() - pt.log())).sum(-1))
    assert (forward_kl(s, s).abs() < 1e-12).all()


def test_jsd_end_points_and_limits():
    s, t = _logits(1)
    torch.testing.assert_close(generalized_jsd(s, t, beta=0.0), forward_kl(s, t))
    torch.testing.assert_close(generalized_jsd(s, t, beta=1.0), reverse_kl(s, t))
    eps = 1e-7  # the mixture formula vanishes at the ends; divided by beta it tends to the KLs
    torch.testing.assert_close(generalized_jsd(s, t, beta=eps) / eps, forward_kl(s, t), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(generalized_jsd(s, t, beta=1 - eps) / eps, reverse_kl(s, t), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_matches_trl_gkd(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd")
    s, t = _logits(2)
    s, t = s.float(), t.float()
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    expected = gkd.GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=temperature)
    ours = generalized_jsd(s, t, beta=beta, temperature=temperature)  # (2, 5)
    mask = labels != -100
    torch.testing.assert_close(ours[mask].sum() / mask.sum(), expected, rtol=1e-5, atol=1e-6)


def test_bad_arguments_fail_clearly():
    s, t = _logits()
    with pytest.raises(ValueError, match="share a vocabulary"):
        forward_kl(s, t[..., :10])
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(s, t, beta=1.5)
    assert set(DISTILL_LOSSES) == {"forward_kl", "reverse_kl", "jsd"}

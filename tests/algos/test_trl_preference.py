"""Preference losses against TRL's own code on identical log-probabilities (trl 1.16).

- DPO (sigmoid, hinge, ipo, robust): `DPOTrainer._compute_loss` on a trainer made with
  object.__new__, a TokenTableModel as the policy and precomputed reference logps.
- KTO: `KTOTrainer._compute_loss` the same way, with KL (mismatched-pair) sequences.
- SimPO and conservative DPO: `CPOTrainer.cpo_loss` (loss_type "simpo" / "sigmoid"+label_smoothing).
- ORPO: `ORPOTrainer.odds_ratio_loss`, plus the NLL term as `get_batch_loss_metrics` adds it.
"""

from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from trl import DPOTrainer, KTOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

from posttrain.algos.preference import PREFERENCE_LOSSES  # noqa: E402

from .trl_stubs import FakeAccelerator, TokenTableModel, new_metrics, sequences  # noqa: E402

VOCAB, LENGTH, PAIRS = 50, 16, 5
TOL = dict(atol=1e-6, rtol=1e-6)


def _table(seed: int) -> torch.Tensor:
    return -torch.rand(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def _sums_and_lengths(model: TokenTableModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return model.per_token_logps(labels).sum(-1), batch["completion_mask"].sum(-1).double()


def _dpo_trainer(loss_type: str, beta: float, label_smoothing: float) -> DPOTrainer:
    trainer = object.__new__(DPOTrainer)
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = FakeAccelerator()
    trainer.aux_loss_enabled = False
    trainer.ld_alpha = None
    trainer.precompute_ref_logps = True
    trainer.f_divergence_type = "reverse_kl"
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    trainer.beta, trainer.label_smoothing = beta, label_smoothing
    trainer.use_weighting = False
    trainer._metrics, trainer._total_train_tokens, trainer._tp_size = new_metrics(), 0, 1
    return trainer


@pytest.mark.parametrize(
    "name, trl_name, params",
    [
        ("sigmoid", "sigmoid", {"beta": 0.1}),
        ("hinge", "hinge", {"beta": 0.3}),
        ("ipo", "ipo", {"beta": 0.1}),
        ("robust", "robust", {"beta": 0.1, "label_smoothing": 0.2}),
    ],
)
def test_dpo_family_matches_trl_dpo_trainer(name: str, trl_name: str, params: dict) -> None:
    model = TokenTableModel(_table(0))
    batch = sequences(2 * PAIRS, LENGTH, VOCAB, seed=1)  # rows [chosen..., rejected...], as TRL batches them
    ref_logps = -torch.rand(2 * PAIRS, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 20
    trainer = _dpo_trainer(trl_name, params["beta"], params.get("label_smoothing", 0.0))
    inputs = dict(batch, ref_chosen_logps=ref_logps[:PAIRS], ref_rejected_logps=ref_logps[PAIRS:])
    trl_loss = trainer._compute_loss(model, inputs, return_outputs=False)

    logps, lengths = _sums_and_lengths(model, batch)
    tensors = dict(
        policy_chosen_logps=logps[:PAIRS],
        policy_rejected_logps=logps[PAIRS:],
        ref_chosen_logps=ref_logps[:PAIRS],
        ref_rejected_logps=ref_logps[PAIRS:],
    )
    if name == "ipo":
        tensors.update(chosen_lengths=lengths[:PAIRS], rejected_lengths=lengths[PAIRS:])
    loss, metrics = PREFERENCE_LOSSES[name](**tensors, **params)

    torch.testing.assert_close(loss, trl_loss, **TOL)
    logged = trainer._metrics["train"]
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ):
        assert metrics[key].item() == pytest.approx(logged[key][-1], abs=1e-6), key


def _cpo_self(loss_type: str, beta: float, gamma: float, label_smoothing: float) -> SimpleNamespace:
    """The attributes CPOTrainer.cpo_loss reads."""
    return SimpleNamespace(
        alpha=0.0,
        accelerator=FakeAccelerator(),
        loss_type=loss_type,
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=label_smoothing,
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl_cpo_trainer(label_smoothing: float) -> None:
    model = TokenTableModel(_table(3))
    logps, lengths = _sums_and_lengths(model, sequences(2 * PAIRS, LENGTH, VOCAB, seed=4))
    avg = logps / lengths  # CPOTrainer uses average_log_prob=True for simpo
    fake = _cpo_self("simpo", beta=2.0, gamma=0.7, label_smoothing=label_smoothing)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(fake, avg[:PAIRS], avg[PAIRS:])

    loss, metrics = PREFERENCE_LOSSES["simpo"](
        logps[:PAIRS],
        logps[PAIRS:],
        lengths[:PAIRS],
        lengths[PAIRS:],
        beta=2.0,
        gamma=0.7,
        label_smoothing=label_smoothing,
    )
    torch.testing.assert_close(loss, losses.mean(), **TOL)  # SimPO sets cpo_alpha = 0: no NLL term
    torch.testing.assert_close(metrics["rewards/chosen"], chosen_rewards.mean(), **TOL)
    torch.testing.assert_close(metrics["rewards/rejected"], rejected_rewards.mean(), **TOL)


def test_cdpo_matches_trl_label_smoothed_sigmoid() -> None:
    # TRL 1.16's DPOTrainer no longer has cDPO; CPOTrainer.cpo_loss(loss_type="sigmoid") still computes
    # -(1-eps) log sigmoid(beta x) - eps log sigmoid(-beta x) on x = chosen - rejected. Feeding it the log
    # ratios log pi/pi_ref makes x the DPO margin Delta: exactly cDPO (TRL < 1.0's DPO "sigmoid" + label_smoothing).
    gen = torch.Generator().manual_seed(5)
    pc, pr, rc, rr = (-torch.rand(PAIRS, generator=gen, dtype=torch.float64) * 30 for _ in range(4))
    losses, _, _ = CPOTrainer.cpo_loss(_cpo_self("sigmoid", 0.1, 0.0, 0.15), pc - rc, pr - rr)
    loss, _ = PREFERENCE_LOSSES["cdpo"](pc, pr, rc, rr, beta=0.1, label_smoothing=0.15)
    torch.testing.assert_close(loss, losses.mean(), **TOL)


def test_orpo_matches_trl_orpo_trainer() -> None:
    model = TokenTableModel(_table(6))
    logps, lengths = _sums_and_lengths(model, sequences(2 * PAIRS, LENGTH, VOCAB, seed=7))
    avg = logps / lengths  # ORPOTrainer.get_batch_logps(average_log_prob=True)
    fake = SimpleNamespace(beta=0.25, accelerator=FakeAccelerator())
    trl_out = ORPOTrainer.odds_ratio_loss(fake, avg[:PAIRS], avg[PAIRS:])
    losses, chosen_rewards, _, log_odds_ratio, log_odds_chosen = trl_out
    nll = torch.tensor(1.7, dtype=torch.float64)  # TRL's cross-entropy over prompt + chosen response
    trl_loss = nll - losses.mean()  # as ORPOTrainer.get_batch_loss_metrics combines them

    loss, metrics = PREFERENCE_LOSSES["orpo"](
        logps[:PAIRS], logps[PAIRS:], lengths[:PAIRS], lengths[PAIRS:], beta=0.25, chosen_nll=nll
    )
    # odds_ratio_loss casts to float32 itself, so TRL's side is float32 here
    torch.testing.assert_close(loss, trl_loss, check_dtype=False, **TOL)
    torch.testing.assert_close(metrics["log_odds_ratio"], log_odds_ratio, check_dtype=False, **TOL)
    torch.testing.assert_close(metrics["log_odds_chosen"], log_odds_chosen, check_dtype=False, **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], chosen_rewards.mean(), check_dtype=False, **TOL)


def _kto_trainer(beta: float, desirable_weight: float, undesirable_weight: float) -> KTOTrainer:
    trainer = object.__new__(KTOTrainer)
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = FakeAccelerator()
    trainer.calculate_KL = True
    trainer.precompute_ref_logps = True
    trainer.loss_type = "kto"
    trainer.beta, trainer.desirable_weight, trainer.undesirable_weight = beta, desirable_weight, undesirable_weight
    trainer.aux_loss_enabled = False
    trainer._metrics, trainer._total_train_tokens, trainer._tp_size = new_metrics(), 0, 1
    return trainer


@pytest.mark.parametrize("kl_shift", [0.0, 25.0])  # z0 > 0, and z0 clamped to 0 (the reference's KL logps above)
def test_kto_matches_trl_kto_trainer(kl_shift: float) -> None:
    rows = 7
    model = TokenTableModel(_table(8))
    batch = sequences(rows, LENGTH, VOCAB, seed=9)
    kl_batch = sequences(rows, LENGTH, VOCAB, seed=10)  # the mismatched (prompt, completion) pairs
    gen = torch.Generator().manual_seed(11)
    desirable = torch.tensor([True, False, True, True, False, False, True])
    ref_logps = -torch.rand(rows, generator=gen, dtype=torch.float64) * 20
    policy_kl, _ = _sums_and_lengths(model, kl_batch)
    ref_kl = policy_kl - 0.3 * torch.rand(rows, generator=gen, dtype=torch.float64) + kl_shift
    raw_z0 = (policy_kl - ref_kl).mean()  # in (0, 0.3) unshifted, about -25 shifted: the clamp's two sides
    assert (raw_z0 > 0) if kl_shift == 0 else (raw_z0 < -20)
    inputs = dict(
        batch,
        label=desirable,
        ref_logps=ref_logps,
        ref_KL_logps=ref_kl,
        KL_input_ids=kl_batch["input_ids"],
        KL_attention_mask=kl_batch["attention_mask"],
        KL_completion_mask=kl_batch["completion_mask"],
    )
    trainer = _kto_trainer(beta=0.2, desirable_weight=1.0, undesirable_weight=1.5)
    trl_loss = trainer._compute_loss(model, inputs, return_outputs=False)

    policy_logps, _ = _sums_and_lengths(model, batch)
    loss, metrics = PREFERENCE_LOSSES["kto"](
        policy_logps,
        ref_logps,
        desirable,
        policy_kl_logps=policy_kl,
        ref_kl_logps=ref_kl,
        beta=0.2,
        desirable_weight=1.0,
        undesirable_weight=1.5,
    )
    torch.testing.assert_close(loss, trl_loss, **TOL)
    assert metrics["kl"].item() == max(raw_z0.item(), 0.0)
    logged = trainer._metrics["train"]
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert metrics[key].item() == pytest.approx(logged[key][-1], abs=1e-6), key

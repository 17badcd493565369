"""DPO-family preference losses on sequence log-probabilities.

Inputs are per-example tensors (B,), all keyword-addressable with one vocabulary, so a trainer can
compute them once and pass what each loss asks for:
    policy_chosen_logps, policy_rejected_logps   sum over response tokens of log pi(y_t)
    ref_chosen_logps, ref_rejected_logps         the same under the frozen reference model
    chosen_lengths, rejected_lengths             number of response tokens (for length-normalised losses)
Each loss returns (scalar loss, metrics). Metrics are detached 0-dim tensors named as TRL logs them:
rewards/chosen, rewards/rejected (the implicit rewards), rewards/margins, rewards/accuracies
(share of pairs with chosen reward > rejected reward), logps/chosen, logps/rejected.

Definitions checked against trl 1.16 (DPOTrainer._compute_loss, CPOTrainer.cpo_loss,
ORPOTrainer.odds_ratio_loss, KTOTrainer._compute_loss); see tests/algos for the comparisons.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

LossWithMetrics = tuple[Tensor, dict[str, Tensor]]

# Held-out reward accuracy (the DPO trainer's `eval_reward_accuracy`, `posttrain eval preference`'s DPO
# scorer) counts a pair whose implicit-reward difference is within this of 0 as a tie, half a win: the
# reference pass batches and pads differently from the policy pass, so an untrained policy's "zero"
# margins carry float rounding of this order, not a preference.
TIE_TOLERANCE = 1e-4


def _pair_metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor, rejected_logps: Tensor
) -> dict[str, Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


def _logratios(
    policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor
) -> tuple[Tensor, Tensor]:
    """log pi/pi_ref for chosen and rejected, each (B,)."""
    return policy_chosen_logps - ref_chosen_logps, policy_rejected_logps - ref_rejected_logps


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def dpo_sigmoid_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> LossWithMetrics:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): mean_i -log sigmoid(beta * Delta_i),
    Delta = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)). Implicit reward beta * log pi/pi_ref."""
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, _pair_metrics(beta * chosen, beta * rejected, policy_chosen_logps, policy_rejected_logps)


def cdpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> LossWithMetrics:
    """Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"): labels flipped with prob eps,
    mean_i [-(1 - eps) log sigmoid(beta Delta_i) - eps log sigmoid(-beta Delta_i)].
    TRL < 1.0 computed this as loss_type="sigmoid" with label_smoothing; eps = 0 is plain DPO."""
    _check_label_smoothing(label_smoothing)
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (chosen - rejected)  # (B,)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses.mean(), _pair_metrics(beta * chosen, beta * rejected, policy_chosen_logps, policy_rejected_logps)


def robust_dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> LossWithMetrics:
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409, eq. 8), an unbiased loss under flip rate eps:
    mean_i [-(1 - eps) log sigmoid(beta Delta_i) + eps log sigmoid(-beta Delta_i)] / (1 - 2 eps). TRL "robust"."""
    _check_label_smoothing(label_smoothing)
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (chosen - rejected)  # (B,)
    losses = (-(1 - label_smoothing) * F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)) / (
        1 - 2 * label_smoothing
    )
    return losses.mean(), _pair_metrics(beta * chosen, beta * rejected, policy_chosen_logps, policy_rejected_logps)


def hinge_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> LossWithMetrics:
    """Hinge / SLiC-style loss (Zhao et al. 2023, arXiv:2305.10425): mean_i relu(1 - beta Delta_i). TRL "hinge"."""
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    loss = torch.relu(1 - beta * (chosen - rejected)).mean()
    return loss, _pair_metrics(beta * chosen, beta * rejected, policy_chosen_logps, policy_rejected_logps)


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float = 0.1,
) -> LossWithMetrics:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): mean_i (h_i - 1 / (2 beta))^2 with
    h = log pi/pi_ref(y_w) / |y_w| - log pi/pi_ref(y_l) / |y_l|, beta being the paper's tau.
    The per-token averaging is TRL's (confirmed there with the IPO authors); without it the squared
    loss scales with response length. Implicit rewards in the metrics are the unaveraged beta * log pi/pi_ref."""
    chosen, rejected = _logratios(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    h = chosen / chosen_lengths.clamp(min=1) - rejected / rejected_lengths.clamp(min=1)  # (B,)
    loss = (h - 1 / (2 * beta)).square().mean()
    return loss, _pair_metrics(beta * chosen, beta * rejected, policy_chosen_logps, policy_rejected_logps)


def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
) -> LossWithMetrics:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6), reference-free and length-normalised:
    mean_i -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma), gamma the target
    margin. label_smoothing > 0 gives the conservative form, as TRL's CPOTrainer(loss_type="simpo").
    Implicit reward = beta * average logp; logps/* metrics are the average logps."""
    _check_label_smoothing(label_smoothing)
    chosen_avg = policy_chosen_logps / chosen_lengths.clamp(min=1)  # (B,)
    rejected_avg = policy_rejected_logps / rejected_lengths.clamp(min=1)  # (B,)
    logits = beta * (chosen_avg - rejected_avg) - gamma  # (B,)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses.mean(), _pair_metrics(beta * chosen_avg, beta * rejected_avg, chosen_avg, rejected_avg)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float = 0.1,
    chosen_nll: Tensor | None = None,
) -> LossWithMetrics:
    """ORPO (Hong et al. 2024, arXiv:2403.07691, eqs. 4-7): L = L_NLL - beta * mean_i log sigmoid(log odds_i),
    log odds = log(p_w / (1 - p_w)) - log(p_l / (1 - p_l)) with p = exp(average logp) (reference-free).

    chosen_nll: the SFT term. None -> token-mean NLL over the chosen responses of the batch,
    sum_i(-logp_w_i) / sum_i |y_w_i|. TRL's ORPOTrainer averages over prompt + response tokens
    instead; pass that scalar here to reproduce it.
    Extra metrics: nll_loss, log_odds_ratio (mean log sigmoid(log odds)), log_odds_chosen (mean log odds)."""
    chosen_avg = policy_chosen_logps / chosen_lengths.clamp(min=1)  # (B,)
    rejected_avg = policy_rejected_logps / rejected_lengths.clamp(min=1)  # (B,)
    log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))  # (B,)
    log_sig_odds = F.logsigmoid(log_odds)  # (B,)
    if chosen_nll is None:
        chosen_nll = -policy_chosen_logps.sum() / chosen_lengths.sum().clamp(min=1)
    loss = chosen_nll - beta * log_sig_odds.mean()
    metrics = _pair_metrics(beta * chosen_avg, beta * rejected_avg, chosen_avg, rejected_avg)
    metrics.update(
        {
            "nll_loss": chosen_nll.detach(),
            "log_odds_ratio": log_sig_odds.detach().mean(),
            "log_odds_chosen": log_odds.detach().mean(),
        }
    )
    return loss, metrics


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    *,
    policy_kl_logps: Tensor | None = None,
    ref_kl_logps: Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossWithMetrics:
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 7) on unpaired examples.

        z0   = max(0, mean_j(log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))   (detached reference point)
        loss = lambda_D (1 - sigmoid(beta (log pi/pi_ref - z0)))   for desirable y
               lambda_U (1 - sigmoid(beta (z0 - log pi/pi_ref)))   for undesirable y
    averaged over the batch. z0 is TRL's estimate: the KL logps are of mismatched pairs (x_j, y'_j),
    each prompt with another example's completion. TRL averages it across data-parallel ranks before
    the clamp; pass the gathered KL logps to reproduce that. No KL logps -> z0 = 0.

    policy_logps, ref_logps: (B,) sums over response tokens; desirable: (B,) bool;
    policy_kl_logps, ref_kl_logps: (B',). Extra metric: kl (z0). Per-side metrics are left out when
    the batch has no example of that side.
    """
    if (policy_kl_logps is None) != (ref_kl_logps is None):
        raise ValueError("pass both policy_kl_logps and ref_kl_logps, or neither")
    if policy_kl_logps is not None:
        kl = (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    else:
        kl = policy_logps.new_zeros(())
    desirable = desirable.bool()
    logratios = policy_logps - ref_logps  # (B,)
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))  # (B,)
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))  # (B,)
    loss = torch.where(desirable, desirable_losses, undesirable_losses).mean()

    rewards = beta * logratios.detach()  # (B,)
    metrics: dict[str, Tensor] = {"kl": kl}
    for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
        if rows.any():
            metrics[f"rewards/{side}"] = rewards[rows].mean()
            metrics[f"logps/{side}"] = policy_logps.detach()[rows].mean()
    if desirable.any() and (~desirable).any():
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics


PREFERENCE_LOSSES: dict[str, Callable[..., LossWithMetrics]] = {
    "sigmoid": dpo_sigmoid_loss,
    "cdpo": cdpo_loss,
    "robust": robust_dpo_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "simpo": simpo_loss,
    "orpo": orpo_loss,
    "kto": kto_loss,
}

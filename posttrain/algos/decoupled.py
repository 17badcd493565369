"""AReaL's decoupled PPO objective for asynchronous RL (Fu et al. 2025, "AReaL", arXiv:2505.24298, eq. 5).

Three policies: pi_theta (being trained), pi_prox (the proximal policy: the weights the update starts from,
recomputed by the trainer) and pi_behav (the one that sampled, possibly several versions old, with the engine's
logprobs). The clip keeps pi_theta near pi_prox, not near the stale pi_behav; the gap between pi_prox and
pi_behav is corrected by an importance weight that carries no gradient:

    r_t = pi_theta(y_t) / pi_prox(y_t)                      the trust-region ratio
    w_t = pi_prox(y_t) / pi_behav(y_t)                      the behaviour weight (0 where w_t > cap: AReaL's
                                                            behav_imp_weight_cap drops those tokens)
    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))      (dual-clipped when asked)

The policy term of `posttrain.algos.objective.rl_objective` with `OffPolicyParams(mode="decoupled")` and pi_old =
pi_prox is this loss; `decoupled_ppo_loss` states it on its own (tests/algos/test_decoupled.py checks both against
AReaL's formula on identical tensors). With pi_behav = pi_prox (on-policy) it is PPO's clipped loss.

Shapes: logprobs, proximal_logprobs, behaviour_logprobs, mask (B, T); advantages (B,) or (B, T).
"""

from __future__ import annotations

from torch import Tensor

from posttrain.algos.importance import OffPolicyParams, off_policy_weights
from posttrain.algos.losses import dapo_loss


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token decoupled loss (B, T), zero outside the mask, and its metrics (the clip diagnostics of the
    ratio to pi_prox, and off_policy/* of the behaviour weight). `behaviour_cap` None: no token is dropped."""
    per_token, metrics = dapo_loss(
        logprobs, proximal_logprobs.detach(), advantages, mask,
        clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
    )  # fmt: skip
    params = OffPolicyParams("decoupled", "token", cap=float("inf") if behaviour_cap is None else behaviour_cap)
    weight, weight_metrics = off_policy_weights(proximal_logprobs.detach(), behaviour_logprobs, mask, params)
    return per_token * weight, {**metrics, **weight_metrics}

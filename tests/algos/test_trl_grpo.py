"""The RL objective and the GRPO-family advantages against TRL (trl 1.16) on identical log-probabilities.

Losses: `GRPOTrainer._compute_loss` runs on a trainer made with object.__new__ whose
`_get_per_token_logps_and_entropies` returns our tensors, so TRL's own loss code sees the same
logps, entropies, old logps, reference logps, importance weights, advantages and mask as
`posttrain.algos.objective.rl_objective`. Loss values and gradients with respect to the policy logps
(and the entropies) are compared, for every TRL loss type we have, with TRL's KL term (beta > 0), its
vLLM importance-sampling correction (our TIS weight) and its entropy bonus. TRL's bonus is a token mean
whatever the loss type, ours is aggregated with the policy term: the two agree, and are compared, under
token-mean (bnpo, dapo) only.

Advantages: TRL computes them inline in `_generate_and_score_completions`, which needs generation.
Those lines are re-stated below with TRL's own `nanstd` (trl/trainer/grpo_trainer.py lines
2753-2806 for GRPO, trl/trainer/rloo_trainer.py lines 1651-1697 for RLOO, in trl 1.16.0).
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from posttrain.algos.advantages import grpo_advantages, rloo_advantages  # noqa: E402
from posttrain.algos.importance import OffPolicyParams  # noqa: E402
from posttrain.algos.objective import ObjectiveParams, rl_objective  # noqa: E402

from .trl_stubs import FakeAccelerator, new_metrics  # noqa: E402

B, T, MAX_LEN = 8, 10, 12
TOL = dict(atol=1e-6, rtol=1e-6)
TIS_CAP = 1.1  # below the largest weights exp(old - sampler) of the tensors below: some are truncated


def _grpo_trainer(
    loss_type: str,
    level: str,
    eps_low: float,
    eps_high: float,
    params: ObjectiveParams,
    logps: torch.Tensor,
    entropies: torch.Tensor,
):
    """The attributes GRPOTrainer._compute_loss reads (off-policy masks, top-entropy masks, aux loss off)."""
    trainer = object.__new__(GRPOTrainer)
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = FakeAccelerator()
    trainer.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    trainer.loss_type, trainer.importance_sampling_level = loss_type, level
    trainer.beta, trainer.epsilon_low, trainer.epsilon_high = params.kl_coef, eps_low, eps_high
    trainer.top_entropy_quantile, trainer.off_policy_mask_threshold = 1.0, None
    # The vLLM importance-sampling correction multiplies the per-token loss by inputs["importance_sampling_ratio"].
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = params.off_policy is not None
    trainer.current_gradient_accumulation_steps = 1
    trainer.max_completion_length = MAX_LEN
    trainer.entropy_coef, trainer.use_adaptive_entropy = params.entropy_coef, False
    trainer._entropy_bonus_enabled, trainer.aux_loss_enabled = params.entropy_coef != 0, False
    trainer._metrics = new_metrics()
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    return trainer


def trl_truncated_is_ratio(
    old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float, level: str = "token"
) -> torch.Tensor:
    """trl/trainer/grpo_trainer.py (1.16.0) lines 2659-2685, vllm_importance_sampling_mode "token_truncate" or
    "sequence_truncate" with no lower clip: the weight TRL hands its loss as inputs["importance_sampling_ratio"],
    (B, T) per token, (B, 1) per sequence."""
    per_token_logps_diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if level == "sequence":
        per_token_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    return torch.clamp(torch.exp(per_token_logps_diff), min=None, max=cap)


# TRL loss_type, importance level, our objective, TRL eps_low/high, noise of the policy logps around pi_old
CASES = {
    "grpo": (
        "grpo",
        "token",
        ObjectiveParams("grpo", "seq-mean-token-mean", MAX_LEN, {"clip_eps": 0.2}),
        (0.2, 0.2),
        0.3,
    ),
    "bnpo": ("bnpo", "token", ObjectiveParams("ppo_clip", "token-mean", MAX_LEN, {"clip_eps": 0.2}), (0.2, 0.2), 0.3),
    "dr_grpo": (
        "dr_grpo",
        "token",
        ObjectiveParams("ppo_clip", "seq-mean-token-sum-norm", MAX_LEN, {"clip_eps": 0.2}),
        (0.2, 0.2),
        0.3,
    ),
    "dapo": (
        "dapo",
        "token",
        ObjectiveParams("dapo", "token-mean", MAX_LEN, {"clip_eps_low": 0.2, "clip_eps_high": 0.28}),
        (0.2, 0.28),
        0.3,
    ),
    "gspo": (
        "grpo",
        "sequence",
        ObjectiveParams("gspo", "seq-mean-token-mean", MAX_LEN, {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
        (3e-4, 4e-4),
        0.002,
    ),
}
# The objective's other terms, on top of each case's policy loss (TRL's beta is our kl_coef, with k3).
TERMS = {
    "policy": {},
    "kl": {"kl_coef": 0.04},
    "tis+kl": {"off_policy": OffPolicyParams("tis", "token", cap=TIS_CAP), "kl_coef": 0.04},
    "seq_tis+kl": {"off_policy": OffPolicyParams("tis", "sequence", cap=TIS_CAP), "kl_coef": 0.04},
    "entropy+kl": {"entropy_coef": 0.03, "kl_coef": 0.04},
}
TOKEN_MEAN_CASES = ("bnpo", "dapo")  # where TRL's entropy bonus (a token mean) is ours
# GSPO with per-token TIS weights: the loss agrees, the gradient does not. Ours weighs each token's GSPO-token
# gradient s_i * d log pi_t by its own w_t; TRL's sequence ratio spreads the weights, every token getting
# s_i * mean_u(w_u) * d log pi_t. With w = 1 the two coincide (gspo is compared without TIS).
DIFFERENT_IN_TRL = {("gspo", "tis+kl")}
COMBOS = [
    (case, terms)
    for case in CASES
    for terms in TERMS
    if ("entropy" not in terms or case in TOKEN_MEAN_CASES) and (case, terms) not in DIFFERENT_IN_TRL
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case, terms", COMBOS)
def test_objective_matches_trl_grpo_trainer(case: str, terms: str, dtype: torch.dtype) -> None:
    trl_type, level, params, (eps_low, eps_high), noise = CASES[case]
    params = dataclasses.replace(params, **TERMS[terms])
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logps0 = old + noise * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    sampler = old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # the engine's logprobs
    entropy0 = 2 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B, 1), generator=gen)).long()  # no empty rows
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    old, logps0, ref, sampler, entropy0, advantages = (
        x.to(dtype) for x in (old, logps0, ref, sampler, entropy0, advantages)
    )

    trl_logps, trl_entropy = logps0.clone().requires_grad_(), entropy0.clone().requires_grad_()
    trainer = _grpo_trainer(trl_type, level, eps_low, eps_high, params, trl_logps, trl_entropy)
    inputs = {
        "prompt_ids": torch.zeros(B, 3, dtype=torch.long),
        "prompt_mask": torch.ones(B, 3, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    if params.off_policy is not None:
        cap, level = params.off_policy.cap, params.off_policy.level
        weight = trl_truncated_is_ratio(old, sampler, mask, cap, level)
        assert (weight == cap).any() and (weight < 1).any()  # some truncated, some below 1
        inputs["importance_sampling_ratio"] = weight
    trl_loss = trainer._compute_loss(None, inputs)
    trl_loss.backward()

    logps, entropy = logps0.clone().requires_grad_(), entropy0.clone().requires_grad_()
    objective = rl_objective(
        logps,
        advantages,
        mask,
        params,
        old_logprobs=old,
        rollout_logprobs=sampler,
        ref_logprobs=ref if params.kl_coef else None,
        entropy=entropy,
    )
    loss = objective.policy.sum / objective.policy.normaliser
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, **TOL)
    torch.testing.assert_close(logps.grad, trl_logps.grad, **TOL)
    if params.entropy_coef:
        torch.testing.assert_close(entropy.grad, trl_entropy.grad, **TOL)
    metrics, logged = objective.metrics, trainer._metrics["train"]
    assert 0 < metrics["clip_frac/low"] + metrics["clip_frac/high"] < 1  # clipped and unclipped tokens both occur
    assert metrics["entropy"].item() == pytest.approx(logged["entropy"][-1], rel=1e-6)
    if params.kl_coef:
        assert metrics["kl"].item() == pytest.approx(logged["kl"][-1], rel=1e-6)
    if level == "token":  # TRL counts sequence-level clipping per sequence, ours per token
        assert metrics["clip_frac/low"].item() == pytest.approx(logged["clip_ratio/low_mean"][-1], abs=1e-6)
        assert metrics["clip_frac/high"].item() == pytest.approx(logged["clip_ratio/high_mean"][-1], abs=1e-6)


NAN = float("nan")
REWARDS = torch.tensor(
    [1.0, 0.0, 0.5, NAN, 2.0, 2.0, 2.0, 2.0, NAN, NAN, NAN, NAN, 3.0, NAN, NAN, NAN, 0.1, 0.9, 0.4, 0.3]
)


def trl_grpo_advantages(rewards: torch.Tensor, num_generations: int, scale: bool) -> torch.Tensor:
    """trl/trainer/grpo_trainer.py (1.16.0) lines 2765-2787 and 2804, scale_rewards "group" / "none"."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    std_rewards = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    if scale:
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """trl/trainer/rloo_trainer.py (1.16.0) lines 1676-1697, normalize_advantages=False."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = ((grouped_sum - grouped_rewards) / (scorable_counts - 1)).view(-1)
    return torch.nan_to_num(rewards - baselines, nan=0.0)


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages_match_trl(scale: bool) -> None:
    torch.testing.assert_close(grpo_advantages(REWARDS, 4, scale_by_std=scale), trl_grpo_advantages(REWARDS, 4, scale))


def test_rloo_advantages_match_trl() -> None:
    torch.testing.assert_close(rloo_advantages(REWARDS, 4), trl_rloo_advantages(REWARDS, 4))

"""GRPO-family losses and advantages against TRL (trl 1.16) on identical log-probabilities.

Losses: `GRPOTrainer._compute_loss` runs on a trainer made with object.__new__ whose
`_get_per_token_logps_and_entropies` returns our tensor, so TRL's own loss code sees the same
logps, old logps, reference logps, advantages and mask as ours. Loss values and gradients with
respect to the policy logps are compared.

Advantages: TRL computes them inline in `_generate_and_score_completions`, which needs generation.
Those lines are re-stated below with TRL's own `nanstd` (trl/trainer/grpo_trainer.py lines
2753-2806 for GRPO, trl/trainer/rloo_trainer.py lines 1651-1697 for RLOO, in trl 1.16.0).
"""

from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from posttrain.algos.advantages import grpo_advantages, rloo_advantages  # noqa: E402
from posttrain.algos.aggregation import AGGREGATIONS  # noqa: E402
from posttrain.algos.kl import KL_ESTIMATORS  # noqa: E402
from posttrain.algos.losses import POLICY_LOSSES  # noqa: E402

from .trl_stubs import FakeAccelerator, new_metrics  # noqa: E402

B, T, MAX_LEN = 8, 10, 12
TOL = dict(atol=1e-6, rtol=1e-6)


def _grpo_trainer(loss_type: str, level: str, beta: float, eps_low: float, eps_high: float, logps: torch.Tensor):
    """The attributes GRPOTrainer._compute_loss reads (entropy bonus, vLLM, off-policy masks all off)."""
    trainer = object.__new__(GRPOTrainer)
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = FakeAccelerator()
    trainer.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    trainer.loss_type, trainer.importance_sampling_level = loss_type, level
    trainer.beta, trainer.epsilon_low, trainer.epsilon_high = beta, eps_low, eps_high
    trainer.top_entropy_quantile, trainer.off_policy_mask_threshold = 1.0, None
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    trainer.current_gradient_accumulation_steps = 1
    trainer.max_completion_length = MAX_LEN
    trainer._entropy_bonus_enabled, trainer.aux_loss_enabled = False, False
    trainer._metrics = new_metrics()
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    return trainer


# (TRL loss_type, importance level, our policy loss, its params, our aggregation, TRL eps_low/high, noise)
CASES = {
    "grpo": ("grpo", "token", "grpo", {"clip_eps": 0.2}, "seq-mean-token-mean", (0.2, 0.2), 0.3),
    "bnpo": ("bnpo", "token", "ppo_clip", {"clip_eps": 0.2}, "token-mean", (0.2, 0.2), 0.3),
    "dr_grpo": ("dr_grpo", "token", "ppo_clip", {"clip_eps": 0.2}, "seq-mean-token-sum-norm", (0.2, 0.2), 0.3),
    "dapo": ("dapo", "token", "dapo", {"clip_eps_low": 0.2, "clip_eps_high": 0.28}, "token-mean", (0.2, 0.28), 0.3),
    "gspo": ("grpo", "sequence", "gspo", {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}, "seq-mean-token-mean",
             (3e-4, 4e-4), 0.002),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("case", list(CASES))
def test_policy_loss_matches_trl_grpo_trainer(case: str, beta: float, dtype: torch.dtype) -> None:
    trl_type, level, ours_name, params, agg, (eps_low, eps_high), noise = CASES[case]
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logps0 = old + noise * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B, 1), generator=gen)).long()  # no empty rows
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    old, logps0, ref, advantages = (x.to(dtype) for x in (old, logps0, ref, advantages))

    trl_logps = logps0.clone().requires_grad_()
    trainer = _grpo_trainer(trl_type, level, beta, eps_low, eps_high, trl_logps)
    inputs = {
        "prompt_ids": torch.zeros(B, 3, dtype=torch.long), "prompt_mask": torch.ones(B, 3, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    trl_loss = trainer._compute_loss(None, inputs)
    trl_loss.backward()

    logps = logps0.clone().requires_grad_()
    per_token, metrics = POLICY_LOSSES[ours_name](logps, old, advantages, mask, **params)
    if beta:
        per_token = per_token + beta * KL_ESTIMATORS["k3"](logps, ref)
    loss = AGGREGATIONS[agg](per_token, mask, max_len=MAX_LEN)
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, **TOL)
    torch.testing.assert_close(logps.grad, trl_logps.grad, **TOL)
    assert 0 < metrics["clip_frac/low"] + metrics["clip_frac/high"] < 1  # clipped and unclipped tokens both occur
    if level == "token":  # TRL counts sequence-level clipping per sequence, ours per token
        logged = trainer._metrics["train"]
        assert metrics["clip_frac/low"].item() == pytest.approx(logged["clip_ratio/low_mean"][-1], abs=1e-6)
        assert metrics["clip_frac/high"].item() == pytest.approx(logged["clip_ratio/high_mean"][-1], abs=1e-6)


NAN = float("nan")
REWARDS = torch.tensor([1.0, 0.0, 0.5, NAN, 2.0, 2.0, 2.0, 2.0, NAN, NAN, NAN, NAN, 3.0, NAN, NAN, NAN,
                        0.1, 0.9, 0.4, 0.3])


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

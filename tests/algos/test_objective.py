"""The RL objective's sums and normalisers: split over micro-batches they give the whole batch's loss and
gradient for every aggregation (the property gradient accumulation relies on), and missing inputs are
refused by name. Its values against TRL: tests/algos/test_trl_grpo.py."""

import dataclasses

import pytest
import torch

from posttrain.algos.aggregation import AGGREGATIONS
from posttrain.algos.importance import OffPolicyParams
from posttrain.algos.objective import ObjectiveParams, rl_objective

B, T, MAX_LEN = 9, 7, 8
# Float64 sums of ~60 terms of size ~1, split three ways: they agree to a few ulps of 1e-16.
TOL = dict(rtol=1e-12, atol=1e-12)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    lengths = torch.tensor([7, 1, 4, 0, 6, 7, 2, 5, 3])  # row 3 empty: seq-mean-* must not count it
    return {
        "old": old,
        "logps": old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "ref": old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "sampler": old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "entropy": 2 * torch.rand(B, T, generator=gen, dtype=torch.float64),
        "values": torch.randn(B, T, generator=gen, dtype=torch.float64),
        "old_values": torch.randn(B, T, generator=gen, dtype=torch.float64),
        "returns": torch.randn(B, T, generator=gen, dtype=torch.float64),
        "adv": torch.randn(B, generator=gen, dtype=torch.float64),
        "mask": (torch.arange(T) < lengths[:, None]).double(),
    }


def _objective(
    x: dict[str, torch.Tensor], rows: slice, params: ObjectiveParams, logps: torch.Tensor, values: torch.Tensor
):
    return rl_objective(
        logps[rows],
        x["adv"][rows],
        x["mask"][rows],
        params,
        old_logprobs=x["old"][rows],
        rollout_logprobs=x["sampler"][rows],
        ref_logprobs=x["ref"][rows],
        entropy=x["entropy"][rows],
        values=values[rows],
        old_values=x["old_values"][rows],
        returns=x["returns"][rows],
    )


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batch_sums_over_summed_normalisers_are_the_whole_batch(aggregation: str) -> None:
    x = _batch()
    params = ObjectiveParams(
        "dapo",
        aggregation,
        MAX_LEN,
        {"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        off_policy=OffPolicyParams("tis", cap=1.1),
        kl_coef=0.05,
        entropy_coef=0.01,
    )

    def loss_and_grads(splits: list[slice]) -> tuple[torch.Tensor, ...]:
        logps, values = x["logps"].clone().requires_grad_(), x["values"].clone().requires_grad_()
        parts = [_objective(x, rows, params, logps, values) for rows in splits]
        policy_norm = sum(p.policy.normaliser for p in parts)
        value_norm = sum(p.value.normaliser for p in parts)
        loss = sum(p.policy.sum for p in parts) / policy_norm + 0.5 * sum(p.value.sum for p in parts) / value_norm
        loss.backward()
        return loss.detach(), logps.grad, values.grad

    whole = loss_and_grads([slice(0, B)])
    split = loss_and_grads([slice(0, 2), slice(2, 5), slice(5, B)])  # the empty row 3 in the middle part
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, **TOL)
    assert whole[1].abs().sum() > 0 and whole[2].abs().sum() > 0
    want = {
        "token-mean": float(x["mask"].sum()),
        "seq-mean-token-mean": B - 1.0,
        "seq-mean-token-sum": B - 1.0,
        "seq-mean-token-sum-norm": float(B * MAX_LEN),
    }[aggregation]
    assert float(_objective(x, slice(0, B), params, x["logps"], x["values"]).policy.normaliser) == want


def test_value_term_is_the_token_mean_of_the_clipped_value_loss() -> None:
    x = _batch()
    params = ObjectiveParams("ppo_clip", "seq-mean-token-mean", MAX_LEN, value_clip=0.2)
    out = _objective(x, slice(0, B), params, x["logps"], x["values"])
    clipped = x["old_values"] + (x["values"] - x["old_values"]).clamp(-0.2, 0.2)
    per_token = 0.5 * torch.maximum((x["values"] - x["returns"]) ** 2, (clipped - x["returns"]) ** 2)
    torch.testing.assert_close(out.value.mean(), (per_token * x["mask"]).sum() / x["mask"].sum(), **TOL)
    assert out.value.normaliser == x["mask"].sum()


@pytest.mark.parametrize(
    "terms, missing, match",
    [
        ({"off_policy": OffPolicyParams("mis")}, "rollout_logprobs", "off_policy needs rollout_logprobs"),
        ({"kl_coef": 0.1}, "ref_logprobs", "kl_coef > 0 needs ref_logprobs"),
        ({"entropy_coef": 0.1}, "entropy", "entropy_coef > 0 needs the entropy"),
        ({}, "returns", "needs values, old_values and returns"),
    ],
)
def test_a_term_without_its_input_is_refused(terms: dict, missing: str, match: str) -> None:
    x = _batch()
    params = dataclasses.replace(ObjectiveParams("ppo_clip", "token-mean", MAX_LEN), **terms)
    inputs = {
        "old_logprobs": x["old"],
        "rollout_logprobs": x["sampler"],
        "ref_logprobs": x["ref"],
        "entropy": x["entropy"],
        "values": x["values"],
        "old_values": x["old_values"],
        "returns": x["returns"],
    }
    inputs[missing] = None
    with pytest.raises(ValueError, match=match):
        rl_objective(x["logps"], x["adv"], x["mask"], params, **inputs)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="aggregation 'mean' is not one of"):
        ObjectiveParams("ppo_clip", "mean", MAX_LEN)
    with pytest.raises(ValueError, match="kl_estimator 'k4' is not one of"):
        ObjectiveParams("ppo_clip", "token-mean", MAX_LEN, kl_estimator="k4")

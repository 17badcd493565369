"""Samples from served episodes (a harness's model calls) and the GRPO update on them: continuations merge with the
observation between them at mask 0, rewritten histories split, the loss touches only model-sampled tokens, and
one small step moves the policy the way the advantages say."""

from __future__ import annotations

import pytest
import torch

from posttrain.algos.advantages import grpo_advantages
from posttrain.algos.logprobs import token_logprobs
from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer
from posttrain.rollout.served_episodes import TokenSample, samples_from_steps, samples_from_verifiers
from posttrain.trainers.episode_grpo import group_advantages, grpo_update

VOCAB = 32


def tiny() -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Transformer(cfg)


def step(prompt: list[int], sampled: list[int], logprobs: list[float] | None = None) -> dict:
    return {"prompt_ids": prompt, "completion_ids": sampled, "completion_logprobs": logprobs or [-1.0] * len(sampled)}


def test_a_continuation_merges_with_the_observation_at_mask_0() -> None:
    steps = [step([1, 2, 3], [4, 5], [-0.5, -0.25]), step([1, 2, 3, 4, 5, 9, 9], [6], [-0.125])]
    (sample,) = samples_from_steps(steps, reward=2.0, group="q")
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.completion_ids == [4, 5, 9, 9, 6]
    assert sample.completion_mask == [1, 1, 0, 0, 1]
    assert sample.logprobs == [-0.5, -0.25, 0.0, 0.0, -0.125]
    assert (sample.reward, sample.group, sample.num_model_tokens) == (2.0, "q", 3)


def test_a_rewritten_history_starts_a_new_sample() -> None:
    steps = [step([1, 2], [3]), step([1, 2, 7, 8], [4]), step([1, 2, 7, 8, 4, 5], [6])]
    first, second = samples_from_steps(steps, reward=1.0, group=0)
    assert (first.prompt_ids, first.completion_ids, first.completion_mask) == ([1, 2], [3], [1])
    assert (second.prompt_ids, second.completion_ids, second.completion_mask) == ([1, 2, 7, 8], [4, 5, 6], [1, 0, 1])


def test_bad_steps_name_what_is_missing() -> None:
    with pytest.raises(PosttrainError, match="step 1 lacks completion_logprobs"):
        samples_from_steps([step([1], [2]), {"prompt_ids": [1], "completion_ids": [2]}], 0.0, 0)
    with pytest.raises(PosttrainError, match="2 completion ids but 1 logprobs"):
        samples_from_steps([step([1], [2, 3], [-1.0])], 0.0, 0)
    with pytest.raises(PosttrainError, match="state_columns=\\['trajectory'\\]"):
        samples_from_verifiers([{"example_id": 0, "reward": 1.0}])
    with pytest.raises(PosttrainError, match="return_token_ids"):
        samples_from_verifiers([{"example_id": 0, "reward": 1.0, "trajectory": [{"tokens": None}]}])


def test_group_advantages_are_grpos_within_each_group() -> None:
    samples = [TokenSample([1], reward=r, group=g) for r, g in [(1, "a"), (0, "b"), (3, "a"), (2, "b"), (5, "b")]]
    adv = group_advantages(samples)
    torch.testing.assert_close(adv[[0, 2]], grpo_advantages(torch.tensor([1.0, 3.0]), 2))
    torch.testing.assert_close(adv[[1, 3, 4]], grpo_advantages(torch.tensor([0.0, 2.0, 5.0]), 3))


def episodes() -> list[TokenSample]:
    """Two groups of two, each sample a model turn, an observation and a second model turn."""
    out = []
    for group, rewards in enumerate([(1.0, 0.0), (0.0, 2.0)]):
        for j, reward in enumerate(rewards):
            turn1, turn2 = [5 + j, 6, 7 + group], [9, 10 + j]
            steps = [step([1, 2, 3 + group], turn1), step([1, 2, 3 + group, *turn1, 20, 21], turn2)]
            out += samples_from_steps(steps, reward, group)
    return out


def grads(model: Transformer, samples: list[TokenSample]) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves the weights: only the gradient
    grpo_update(model, optimizer, samples, max_grad_norm=None, micro_batch=3)
    return [p.grad.clone() for p in model.parameters()]


def test_the_loss_touches_only_model_tokens() -> None:
    model = tiny()
    samples = episodes()
    for sample in samples:  # the sampling logprobs the server reported: the model's own, so the ratio is 1
        with torch.no_grad():
            logits = model(torch.tensor([sample.ids]))[:, :-1]
            own = token_logprobs(logits, torch.tensor([sample.ids[1:]]))[0, len(sample.prompt_ids) - 1 :]
        sample.logprobs = [x if m else 0.0 for x, m in zip(own.tolist(), sample.completion_mask)]
    before = grads(model, samples)
    for sample in samples:  # what the observations' entries say must not matter
        sample.logprobs = [x if m else -30.0 for x, m in zip(sample.logprobs, sample.completion_mask)]
    after = grads(model, samples)
    assert any(g.abs().sum() > 0 for g in before)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for sample in samples:  # no model token at all: refused, not a silent zero step
        sample.completion_mask = [0] * len(sample.completion_mask)
    with pytest.raises(PosttrainError, match="no sample has a model-sampled token"):
        grpo_update(model, torch.optim.SGD(model.parameters(), lr=0.1), samples)


def test_a_small_step_raises_the_advantage_weighted_logprob() -> None:
    model = tiny()
    samples = episodes()
    adv = group_advantages(samples)

    def objective() -> float:
        total = 0.0
        with torch.no_grad():
            for a, sample in zip(adv.tolist(), samples):
                logits = model(torch.tensor([sample.ids]))[:, :-1]
                lp = token_logprobs(logits, torch.tensor([sample.ids[1:]]))[0, len(sample.prompt_ids) - 1 :]
                total += a * float((lp * torch.tensor(sample.completion_mask, dtype=torch.float32)).sum())
        return total

    for sample in samples:
        with torch.no_grad():
            logits = model(torch.tensor([sample.ids]))[:, :-1]
            own = token_logprobs(logits, torch.tensor([sample.ids[1:]]))[0, len(sample.prompt_ids) - 1 :]
        sample.logprobs = own.tolist()
    start = objective()
    metrics = grpo_update(model, torch.optim.SGD(model.parameters(), lr=0.05), samples)
    assert metrics["abs_log_ratio"] < 1e-5 and metrics["model_tokens"] == 4 * 5
    assert objective() > start

"""A GRPO update on samples collected elsewhere (posttrain.rollout.served_episodes: a verifiers environment or any
harness driving `posttrain serve`), the loss on the model's own sampled tokens only.

    samples = samples_from_verifiers(results["outputs"])
    metrics = grpo_update(model, optimizer, samples, temperature=1.0)

Per sample b with reward r_b in its group g (the samples sharing `group`; an episode split into several samples
counts once per sample): A_b = (r_b - mean_g r) / (std_g r + eps) (algos.advantages.grpo_advantages). Per
completion token t: the PPO clipped surrogate of r_t = exp(log pi(y_t) - log pi_old(y_t)) with pi_old the logprob
the server reported when it sampled y_t (algos.losses.ppo_clip_loss), times the mask (1 on sampled tokens, 0 on
observations and prompt), summed over every sample and divided by the number of masked tokens (DAPO's token
mean). `temperature` must be the one the samples were drawn at: the server's logprobs are log softmax(z / T).
One optimizer step per call over all samples, in micro-batches of `micro_batch` sequences.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor, nn

from posttrain.algos.advantages import grpo_advantages
from posttrain.algos.logprobs import token_logprobs
from posttrain.algos.losses import ppo_clip_loss
from posttrain.errors import PosttrainError
from posttrain.rollout.served_episodes import TokenSample


def group_advantages(samples: Sequence[TokenSample], *, scale_by_std: bool = True) -> Tensor:
    """(B,) GRPO advantages, each sample against the others of its group (groups may differ in size)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    out = torch.zeros(len(samples), dtype=torch.float32)
    members: dict[Hashable, list[int]] = {}
    for b, sample in enumerate(samples):
        members.setdefault(sample.group, []).append(b)
    for rows in members.values():
        index = torch.tensor(rows)
        out[index] = grpo_advantages(rewards[index], len(rows), scale_by_std=scale_by_std)
    return out


def grpo_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TokenSample],
    *,
    temperature: float = 1.0,
    clip_eps: float = 0.2,
    scale_by_std: bool = True,
    micro_batch: int = 4,
    max_grad_norm: float | None = 1.0,
) -> dict[str, float]:
    """One GRPO step on `samples`; returns the loss, the model-token count, the policy's mean |log ratio| against
    the sampling logprobs (0 up to numerics when the model is the one that sampled), and the clipped share."""
    if not samples:
        raise PosttrainError("grpo_update got no samples")
    num_tokens = sum(s.num_model_tokens for s in samples)
    if num_tokens == 0:
        raise PosttrainError("grpo_update: no sample has a model-sampled token (every completion_mask is 0)")
    advantages = group_advantages(samples, scale_by_std=scale_by_std)
    device = next(model.parameters()).device
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = abs_log_ratio = clipped = 0.0
    for start in range(0, len(samples), micro_batch):
        chunk = samples[start : start + micro_batch]
        ids, labels, old, mask = _padded(chunk, device)
        logits = model(ids)[:, :-1]  # (b, T-1, V): position t predicts ids[:, t + 1]
        new = token_logprobs(logits, labels, temperature)  # (b, T-1)
        adv = advantages[start : start + len(chunk)].to(device)
        loss, _ = ppo_clip_loss(new, old, adv, mask, clip_eps=clip_eps)  # (b, T-1), 0 off the mask
        total = loss.sum() / num_tokens
        total.backward()
        loss_sum += float(total.detach())
        log_ratio = (new.detach() - old) * mask
        abs_log_ratio += float(log_ratio.abs().sum())
        ratio = log_ratio.exp()
        clipped += float((((ratio - 1).abs() > clip_eps) & (mask > 0)).sum())
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()  # the gradients stay in .grad until the next call (as after loss.backward())
    return {
        "loss": loss_sum,
        "model_tokens": float(num_tokens),
        "abs_log_ratio": abs_log_ratio / num_tokens,
        "clip_frac": clipped / num_tokens,
    }


def _padded(samples: Sequence[TokenSample], device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ids (b, T); labels, old logprobs and mask (b, T-1), aligned with the logits that predict each label: the
    prompt's and the padding's labels carry mask 0 (labels -100 on padding)."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width - 1), -100, dtype=torch.long)
    old = torch.zeros(len(samples), width - 1)
    mask = torch.zeros(len(samples), width - 1)
    for b, s in enumerate(samples):
        seq = s.ids
        ids[b, : len(seq)] = torch.tensor(seq)
        labels[b, : len(seq) - 1] = torch.tensor(seq[1:])
        first = len(s.prompt_ids) - 1  # the logit predicting the first completion token
        end = first + len(s.completion_ids)
        old[b, first:end] = torch.tensor(s.logprobs)
        mask[b, first:end] = torch.tensor(s.completion_mask, dtype=torch.float32)
    return ids.to(device), labels.to(device), old.to(device), mask.to(device)

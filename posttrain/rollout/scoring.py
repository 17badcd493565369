"""Scoring rollouts: which reward functions a run uses, rewards for every sample, DAPO's soft overlong
penalty, and the groups DAPO's dynamic sampling drops."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from posttrain.algos import dapo_dynamic_sampling_mask, soft_overlong_penalty
from posttrain.errors import PosttrainError
from posttrain.rewards import COMPLETION_IDS_COLUMN, RewardResult, RewardSpec, compute_rewards
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch
from posttrain.rollout.prompts import PromptData, PromptSource
from posttrain.tasks import TASK_DEFAULT_REWARDS


class RewardChoice(Protocol):
    """The reward functions a run names (the RL config's `reward:` section has this field)."""

    functions: Sequence[str]  # `load_reward` specs; empty: the data's default reward


def reward_names(cfg: RewardChoice, data: PromptData, source: PromptSource) -> list[str]:
    """`reward.functions`, or the task's default reward when it names none."""
    if cfg.functions:
        return list(cfg.functions)
    default = getattr(source, "reward", "") or TASK_DEFAULT_REWARDS.get(data.task or "", "")
    if not default:
        raise PosttrainError(
            "reward.functions is empty and the data has no default reward: name one, "
            "e.g. reward.functions=[numeric_match]"
        )
    return [default]


@dataclass(frozen=True)
class OverlongShaping:
    max_tokens: int
    cache_len: int
    factor: float


def score_groups(batch: RolloutBatch, specs: list[RewardSpec], overlong: OverlongShaping | None) -> RolloutBatch:
    """Rewards for every sample (the group's row columns repeated per sample), then the overlong penalty.

    Episodes (batch.env_rewards set): an episode's own reward wins where it has one, the reward functions
    score the rest (their `completions` are the episode's messages after the opening ones), and the per-turn
    rewards are added when the run asks for them (batch.turn_rewards)."""
    G = batch.group_size
    prompts = [row[PROMPT_KEY] for row in batch.rows for _ in range(G)]
    names = [k for k in batch.rows[0] if k != PROMPT_KEY]
    columns: dict[str, list[Any]] = {k: [row.get(k) for row in batch.rows for _ in range(G)] for k in names}
    columns[COMPLETION_IDS_COLUMN] = batch.completion_ids
    if batch.env_rewards is None:
        result = compute_rewards(specs, prompts, batch.texts, columns)
    else:
        needed = specs and any(r is None for r in batch.env_rewards)  # else: every episode scored itself
        unscored = RewardResult(torch.full((batch.num_samples,), math.nan), {}, batch.num_samples)
        result = compute_rewards(specs, prompts, batch.completion_messages, columns) if needed else unscored
        result = _with_episode_rewards(result, batch.env_rewards, batch.turn_rewards)
    rewards = result.total.clone()  # (B,)
    if overlong is not None:
        lengths = torch.tensor([len(ids) for ids in batch.completion_ids], dtype=torch.float32)
        rewards = rewards + soft_overlong_penalty(
            lengths, overlong.max_tokens, overlong.cache_len, penalty_factor=overlong.factor
        )
    return replace(
        batch, rewards=rewards, task_rewards=result.total, per_function=result.per_function, reward_errors=result.errors
    )


def _with_episode_rewards(
    result: RewardResult, env_rewards: list[float | None], turn_rewards: list[float] | None
) -> RewardResult:
    """The episodes' own rewards in place of the functions' where given (NaN: unscorable), plus per-turn sums."""
    own = torch.tensor([math.nan if r is None else r for r in env_rewards], dtype=torch.float32)  # (B,)
    given = torch.tensor([r is not None for r in env_rewards])  # (B,)
    total = torch.where(given, own, result.total)
    if turn_rewards is not None:
        total = total + torch.tensor(turn_rewards, dtype=torch.float32)
    return replace(result, total=total, num_unscorable=int(torch.isnan(total).sum()))


def zero_variance_groups(batch: RolloutBatch) -> torch.Tensor:
    """(num_groups,) bool: the groups DAPO's dynamic sampling drops, decided on correctness.

    DAPO (eq. 11) keeps a group when 0 < #correct < G, and verl filters on `acc` (the scorer's
    correctness, before its overlong penalty) by keeping groups whose values have std > 0. Here: the
    task rewards (the reward functions' total, before the soft overlong penalty) must not all be equal.
    For a 0/1 reward that is exactly 0 < #correct < G. For a graded reward (partial credit, a format
    bonus) a group whose task rewards differ still carries a task signal and is kept; a threshold on
    "correct" would throw that away. A group whose only spread is the length penalty (all wrong, some
    overlong) is dropped: it would train on length alone. The advantage still uses the shaped rewards.
    Groups with < 2 scorable rewards are dropped too (see dapo_dynamic_sampling_mask)."""
    task = batch.task_rewards if batch.task_rewards is not None else batch.rewards  # (B,)
    keep = dapo_dynamic_sampling_mask(task, batch.group_size).reshape(-1, batch.group_size)[:, 0]  # (N,)
    return ~keep

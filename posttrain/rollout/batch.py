"""The rollout batch: G sampled completions of each of N prompts, with what the trainer needs of each."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

PROMPT_KEY = "prompt"  # every row handed to the trainer carries its prompt under this key
EPISODE_FIELDS = ("completion_mask", "completion_messages", "env_rewards", "turn_rewards", "token_rewards")


@dataclass
class RolloutBatch:
    """G samples per group, samples numbered group by group (sample b = g * G + j)."""

    group_size: int
    rows: list[dict[str, Any]]  # per group: the prompt and its columns
    prompt_ids: list[list[int]]  # per group
    completion_ids: list[list[int]]  # per sample
    texts: list[str]  # per sample
    rollout_logprobs: list[list[float]]  # per sample: the engine's log softmax(z / T) of each token
    finish_reasons: list[str]  # per sample
    policy_versions: list[int]  # per sample: the oldest version among its sampled tokens
    # Per sample, per completion token (aligned with completion_ids): the engine's policy version under which the
    # token was drawn. Episodes: an observation token carries the version of the model token before it (it was not
    # sampled; the staleness of a sample is read over its sampled tokens only, see rollout.staleness).
    token_versions: list[list[int]] = field(default_factory=list)
    rewards: torch.Tensor | None = None  # (B,) after shaping; NaN = unscorable
    task_rewards: torch.Tensor | None = None  # (B,) before the overlong penalty
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_errors: list[str] = field(default_factory=list)
    # Multi-turn episodes (posttrain.rollout.episodes); all None for single-turn completions. A completion is
    # then everything after the opening prompt: the model's turns and the observations between them.
    completion_mask: list[list[int]] | None = None  # per sample, per token: 1 sampled by the model, 0 observation
    completion_messages: list[list[dict[str, Any]]] | None = None  # per sample: what the reward functions see
    env_rewards: list[float | None] | None = None  # per sample: the episode's own reward; None: score it
    turn_rewards: list[float] | None = None  # per sample: per-turn rewards added to the outcome (env.turn_rewards)
    # per sample, per token: each per-turn reward on the last model token of its turn, 0 elsewhere
    # (env.turn_rewards=per_turn, for the token-level advantages)
    token_rewards: list[list[float]] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    @property
    def num_samples(self) -> int:
        return len(self.completion_ids)

    def token_version_tensor(self) -> torch.Tensor:
        """(B, L) long: `token_versions` padded on the right with the sample's last version (L = the longest
        completion); a sample with no token holds its `policy_versions` entry."""
        L = max((len(ids) for ids in self.completion_ids), default=0)
        out = torch.zeros(self.num_samples, L, dtype=torch.long)
        for b, versions in enumerate(self.token_versions):
            row = list(versions) or [self.policy_versions[b]]
            out[b] = torch.tensor(row + [row[-1]] * (L - len(row)), dtype=torch.long)[:L]
        return out

    def grouped(self, per_sample: list[Any]) -> list[list[Any]]:
        """A per-sample list (in the batch's order) cut into its groups of group_size."""
        G = self.group_size
        return [per_sample[g * G : (g + 1) * G] for g in range(self.num_groups)]

    def group_completions(self) -> list[list[list[int]]]:
        return self.grouped(self.completion_ids)

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        G = self.group_size
        samples = [g * G + j for g in groups for j in range(G)]
        index = torch.tensor(samples, dtype=torch.long)

        def pick(values: Any) -> Any:
            if values is None:
                return None
            if isinstance(values, torch.Tensor):
                return values[index]
            return [values[b] for b in samples]

        return replace(
            self,
            rows=[self.rows[g] for g in groups],
            prompt_ids=[self.prompt_ids[g] for g in groups],
            completion_ids=pick(self.completion_ids),
            texts=pick(self.texts),
            rollout_logprobs=pick(self.rollout_logprobs),
            finish_reasons=pick(self.finish_reasons),
            policy_versions=pick(self.policy_versions),
            token_versions=pick(self.token_versions),
            rewards=pick(self.rewards),
            task_rewards=pick(self.task_rewards),
            per_function={k: pick(v) for k, v in self.per_function.items()},
            **{name: pick(getattr(self, name)) for name in EPISODE_FIELDS},
        )


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """The groups of `batches`, in order, as one batch (all of one group size)."""
    first = batches[0]

    def first_has(name: str) -> bool:
        return getattr(first, name) is not None

    def cat(name: str) -> Any:
        values = [getattr(b, name) for b in batches]
        if isinstance(values[0], torch.Tensor):
            return torch.cat(values)
        return [v for vs in values for v in vs]

    return replace(
        first,
        **{
            name: cat(name)
            for name in (
                "rows",
                "prompt_ids",
                "completion_ids",
                "texts",
                "rollout_logprobs",
                "finish_reasons",
                "policy_versions",
                "token_versions",
                "rewards",
                "task_rewards",
            )
        },
        **{name: cat(name) if first_has(name) else None for name in EPISODE_FIELDS},
        per_function={k: torch.cat([b.per_function[k] for b in batches]) for k in first.per_function},
        reward_errors=[e for b in batches for e in b.reward_errors],
    )

"""Task accuracy: generate for each prompt, score every sample with reward functions, count a sample
correct when its total reward is >= `threshold` (1.0: full credit on 0/1 answer rewards).

- Scoring is the RL trainer's (`score_groups`: every function called once on the batch, TRL's signature,
  the row's columns as keywords); a None / NaN reward, or a function that raised, makes a sample
  *unscorable*: it is counted on its own and left out of every denominator, never counted as wrong.
- `accuracy` is correct / scorable over all samples (`posttrain.tasks.accuracy`, as the trainer reports it).
- With n samples per problem, `pass_at_k[k]` is the unbiased estimator averaged over the problems with
  at least k scorable samples (`problems_for_k[k]` of them); for n = 1, pass@1 equals the accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from posttrain.engine import LLM
from posttrain.errors import PosttrainError
from posttrain.eval.generation import Sampling, sample
from posttrain.eval.pass_at_k import check_ks, mean_pass_at_k
from posttrain.rewards import COMPLETION_IDS_COLUMN, RewardSpec, check_reward_signature, load_reward_specs
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch
from posttrain.rollout.scoring import score_groups
from posttrain.tasks import accuracy as task_accuracy

SAMPLES_KEPT = 200  # per-sample records returned for inspection (--samples FILE writes them)
NO_REWARD = "no reward function: name one with --reward (a built-in, e.g. numeric_match, or path/to/file.py:function)"


@dataclass
class AccuracyResult:
    accuracy: float | None  # correct / scorable samples; None when nothing was scorable
    pass_at_k: dict[int, float]  # k -> mean pass@k over problems with >= k scorable samples
    problems_for_k: dict[int, int]  # k -> how many problems that mean is over
    problems: int
    samples_per_problem: int
    samples: int
    scorable: int
    correct: int
    unscorable: int  # reward None / NaN, or the reward function raised
    threshold: float
    reward_mean: float | None  # mean total reward over scorable samples
    mean_completion_tokens: float
    reward_errors: list[str] = field(default_factory=list)  # the first messages of functions that raised
    records: list[dict[str, Any]] = field(default_factory=list)  # up to SAMPLES_KEPT samples

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("records")
        out["pass_at_k"] = {f"pass@{k}": v for k, v in self.pass_at_k.items()}
        out["problems_for_k"] = {f"pass@{k}": v for k, v in self.problems_for_k.items()}
        return out


def row_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The columns every row has, besides the prompt (what a reward function is called with)."""
    common = set(rows[0]).intersection(*rows[1:]) - {PROMPT_KEY}
    return [key for key in rows[0] if key in common]


def evaluate_accuracy(
    llm: LLM,
    rows: list[dict[str, Any]],
    rewards: Sequence[str] | Sequence[RewardSpec],
    *,
    sampling: Sampling = Sampling(),
    ks: Sequence[int] | None = None,
    threshold: float = 1.0,
    progress: bool = False,
) -> AccuracyResult:
    """Generate `sampling.n` completions per row, score them, and count (see the module docstring).

    `rewards`: spec strings or ready RewardSpecs. `ks` defaults to (1, n)."""
    if not rows:
        raise PosttrainError("no prompts to evaluate")
    if not math.isfinite(threshold):
        raise PosttrainError(f"--threshold must be a finite number, got {threshold!r}")
    sampling.validate()
    ks = check_ks(ks if ks is not None else (1, sampling.n), sampling.n)
    if rewards and all(isinstance(spec, RewardSpec) for spec in rewards):
        specs = list(rewards)
        for spec in specs:  # before any generation: a signature that cannot take the columns fails now
            check_reward_signature(spec.fn, spec.name, [*row_columns(rows), COMPLETION_IDS_COLUMN])
    elif rewards:
        specs = load_reward_specs(list(rewards), row_columns(rows))  # type: ignore[arg-type]
    else:
        raise PosttrainError(NO_REWARD)
    batch = score_groups(sample(llm, rows, sampling, progress), specs, None)
    return summarize(batch, ks, threshold)


def summarize(batch: RolloutBatch, ks: Sequence[int], threshold: float) -> AccuracyResult:
    """Counts, accuracy and pass@k of a scored batch."""
    rewards = batch.rewards.tolist()  # (B,) NaN = unscorable
    # Rewards are float32 (the trainer's precision): 0.7 is stored as 0.69999999. Compare against the
    # threshold at that precision too, so a reward of exactly `threshold` counts as correct.
    threshold_f32 = float(torch.tensor(threshold, dtype=batch.rewards.dtype))
    n = batch.group_size
    scorable = [r for r in rewards if not math.isnan(r)]
    correct = [not math.isnan(r) and r >= threshold_f32 for r in rewards]
    counts = []  # (scorable, correct) per problem
    for g in range(batch.num_groups):
        group = range(g * n, (g + 1) * n)
        counts.append((sum(not math.isnan(rewards[b]) for b in group), sum(correct[b] for b in group)))
    pass_k, problems_k = {}, {}
    for k in ks:
        eligible = [(m, c) for m, c in counts if m >= k]
        problems_k[k] = len(eligible)
        if eligible:
            pass_k[k] = mean_pass_at_k(eligible, k)
    lengths = [len(ids) for ids in batch.completion_ids]
    records = [
        {
            "problem": b // n,
            "sample": b % n,
            "prompt": batch.rows[b // n][PROMPT_KEY],
            "completion": batch.texts[b],
            "answer": batch.rows[b // n].get("answer"),
            "reward": None if math.isnan(rewards[b]) else rewards[b],
            "correct": correct[b],
        }
        for b in range(min(len(rewards), SAMPLES_KEPT))
    ]
    return AccuracyResult(
        accuracy=task_accuracy(rewards, threshold_f32) if scorable else None,
        pass_at_k=pass_k,
        problems_for_k=problems_k,
        problems=batch.num_groups,
        samples_per_problem=n,
        samples=len(rewards),
        scorable=len(scorable),
        correct=sum(correct),
        unscorable=len(rewards) - len(scorable),
        threshold=threshold,
        reward_mean=sum(scorable) / len(scorable) if scorable else None,
        mean_completion_tokens=sum(lengths) / max(len(lengths), 1),
        reward_errors=list(batch.reward_errors),
        records=records,
    )

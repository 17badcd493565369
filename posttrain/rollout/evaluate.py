"""Held-out evaluation through the rollout engine: greedy accuracy on the RL run's held-out prompts."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.rewards import RewardSpec
from posttrain.rollout.batch import PROMPT_KEY
from posttrain.rollout.generate import EngineCall, GroupGenerator, generate_groups
from posttrain.rollout.scoring import score_groups


@torch.no_grad()
def evaluate(
    llm: LLM,
    rows: list[dict[str, Any]],
    specs: list[RewardSpec],
    max_tokens: int,
    threshold: float,
    lockstep: EngineCall = nullcontext,
    generate: GroupGenerator = generate_groups,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy accuracy on `rows`: the share of scorable samples whose total reward is >= threshold.
    `lockstep`: see generate_groups. `generate`: generate_groups, or an `EpisodeGroups` (each row played as one
    greedy episode, whose turns take `max_tokens` each)."""
    from posttrain.tasks import accuracy

    batch = generate(llm, rows, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens), lockstep=lockstep)
    batch = score_groups(batch, specs, None)
    rewards = batch.rewards.tolist()
    try:
        acc = accuracy(rewards, threshold)
    except ValueError:
        acc = math.nan
    lengths = [len(ids) for ids in batch.completion_ids]
    metrics = {
        "eval/accuracy": acc,
        "eval/reward_mean": float(torch.nanmean(batch.rewards)) if rewards else math.nan,
        "eval/response_len_mean": sum(lengths) / max(len(lengths), 1),
        "eval/num_prompts": len(rows),
    }
    samples = [
        {
            "prompt": row[PROMPT_KEY],
            "completion": text,
            "reward": None if math.isnan(r) else r,
            **{k: v for k, v in row.items() if k != PROMPT_KEY and isinstance(v, (str, int, float))},
        }
        for row, text, r in zip(batch.rows, batch.texts, rewards)
    ]
    return metrics, samples

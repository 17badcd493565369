"""Length shaping on completion token counts.

Lengths are read from the `completion_ids` column when the trainer passes it (one list of token ids
per sample, without padding — the trainer's rollout output); without it they fall back to the number
of characters of the completion text, so `max_len` is then in characters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from posttrain.rewards.base import RewardError, RewardFn, completion_text

COMPLETION_IDS_COLUMN = "completion_ids"


def completion_lengths(completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None) -> list[int]:
    """Token counts from `completion_ids` if given, else character counts of the completions."""
    if completion_ids is None:
        return [len(completion_text(completion)) for completion in completions]
    if len(completion_ids) != len(completions):
        raise ValueError(f"{COMPLETION_IDS_COLUMN} has {len(completion_ids)} rows for {len(completions)} completions")
    return [len(ids) for ids in completion_ids]


def _positive_int(value: Any, name: str, factory: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RewardError(f"{factory}: {name} must be a positive integer, got {value!r}")
    return value


def _finite(value: Any, name: str, factory: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"{factory}: {name} must be a finite number, got {value!r}")
    return float(value)


def length_penalty(max_len: int, *, penalty_factor: float = 1.0) -> RewardFn:
    """A linear length penalty: -penalty_factor * min(len, max_len) / max_len, in [-penalty_factor, 0].

    Pushes toward shorter completions at a constant rate per token; use its weight (or penalty_factor)
    to keep it small next to the task reward.
    """
    max_len = _positive_int(max_len, "max_len", "length_penalty")
    penalty_factor = _finite(penalty_factor, "penalty_factor", "length_penalty")

    def length_penalty_fn(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        lengths = completion_lengths(completions, kwargs.get(COMPLETION_IDS_COLUMN))
        return [-penalty_factor * min(n, max_len) / max_len for n in lengths]

    return length_penalty_fn


def overlong_penalty(max_len: int, cache_len: int, *, penalty_factor: float = 1.0) -> RewardFn:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), times penalty_factor:

        0                                         if len <= max_len - cache_len
        ((max_len - cache_len) - len) / cache_len  if max_len - cache_len < len <= max_len
        -1                                        if len > max_len

    max_len is the completion budget; the last cache_len tokens of it are the soft-penalty zone.
    """
    max_len = _positive_int(max_len, "max_len", "overlong_penalty")
    cache_len = _positive_int(cache_len, "cache_len", "overlong_penalty")
    penalty_factor = _finite(penalty_factor, "penalty_factor", "overlong_penalty")
    if cache_len > max_len:
        raise RewardError(f"overlong_penalty: need cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")

    def overlong_penalty_fn(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        import torch

        from posttrain.algos.advantages import soft_overlong_penalty  # the one definition of the formula

        lengths = torch.tensor(completion_lengths(completions, kwargs.get(COMPLETION_IDS_COLUMN)))  # (B,)
        return soft_overlong_penalty(lengths, max_len, cache_len, penalty_factor=penalty_factor).tolist()

    return overlong_penalty_fn

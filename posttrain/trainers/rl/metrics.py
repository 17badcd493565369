"""Step metrics of the RL trainers: timing, memory, batch statistics."""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from posttrain.rollout.episode_batch import episode_metrics

if TYPE_CHECKING:
    from posttrain.rollout.batch import RolloutBatch
    from posttrain.rollout.collect import RolloutStats
    from posttrain.rollout.episode_batch import EpisodeGroups


def collection_metrics(
    stats: RolloutStats, batch: RolloutBatch | None, dynamic_sampling: bool, episodes: EpisodeGroups | None
) -> dict[str, Any]:
    """The metrics of a step's collection: zero-variance share, episodes' (their log is taken), DAPO's refills,
    the rollout's token rate."""
    metrics: dict[str, Any] = {"zero_variance_frac": stats.zero_variance_frac}
    if episodes is not None:
        metrics.update(episode_metrics(episodes.take_log()))
    if dynamic_sampling:
        metrics.update(
            {
                "dapo/refill_rounds": stats.refill_rounds,
                "dapo/extra_prompts": stats.extra_prompts,
                "dapo/dropped_groups": stats.dropped_groups,
                "dapo/kept_groups": batch.num_groups if batch is not None else 0,
            }
        )
    metrics["tokens/rollout_per_s"] = stats.generated_tokens / max(stats.rollout_s, 1e-9)
    return metrics


class StepTimer:
    """Wall-clock seconds per phase of one step: `with timer("rollout"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}_s": round(s, 4) for phase, s in self.seconds.items()}


class WeightedMeans:
    """Running means of metrics across micro-batches, each weighted (by its token count)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = {}

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for key, value in metrics.items():
            value = float(value)
            if key.endswith("max"):  # ratio/max, mismatch/abs_diff_max: the max over micro-batches
                self.maxima[key] = max(self.maxima.get(key, -math.inf), value)
                continue
            self.sums[key] += value * weight
            self.weights[key] += weight

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}
        out.update(self.maxima)
        return out


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak resident memory of the process (CPU), and CUDA max allocated when on a GPU."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss_kb if sys.platform == "darwin" else rss_kb * 1024  # macOS reports bytes, Linux KiB
    out = {"memory/peak_rss_gb": round(rss_bytes / 2**30, 3)}
    if device.type == "cuda":
        out["memory/cuda_max_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return out


def nan_stats(values: torch.Tensor, prefix: str) -> dict[str, float]:
    """Mean and std over the finite entries (NaN when none)."""
    finite = values[~torch.isnan(values)].float()
    if finite.numel() == 0:
        return {f"{prefix}/mean": math.nan, f"{prefix}/std": math.nan}
    std = float(finite.std()) if finite.numel() > 1 else 0.0
    return {f"{prefix}/mean": float(finite.mean()), f"{prefix}/std": std}


def batch_metrics(batch: RolloutBatch) -> dict[str, Any]:
    """The rollout batch's reward, length and finish statistics."""
    lengths = torch.tensor([len(ids) for ids in batch.completion_ids], dtype=torch.float32)
    out: dict[str, Any] = {}
    out.update(nan_stats(batch.rewards, "reward"))
    if batch.task_rewards is not None and not torch.equal(
        batch.task_rewards.nan_to_num(-7), batch.rewards.nan_to_num(-7)
    ):
        out.update(nan_stats(batch.task_rewards, "reward/task"))
    for name, values in batch.per_function.items():
        out.update(nan_stats(values, f"reward/{name}"))
    out["reward/unscorable"] = int(torch.isnan(batch.rewards).sum())
    out["response_len/mean"] = float(lengths.mean())
    out["response_len/max"] = float(lengths.max())
    out["response_len/clipped_frac"] = sum(r == "length" for r in batch.finish_reasons) / len(batch.finish_reasons)
    out["num_samples"] = batch.num_samples
    if batch.reward_errors:
        out["reward/error"] = batch.reward_errors[0][:200]
    return out

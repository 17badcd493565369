"""Staleness of rollout samples in asynchronous RL: how many policy versions behind the trainer a sample is, and
the bound `rollout.max_staleness` = k that decides which samples the update may use.

A policy version is the engine's `policy_version`: one per optimizer step (`weights_updated()`). Every
generated token records the version it was drawn under (`RolloutBatch.token_versions`). At version v a sample
may be used only if every one of its *sampled* tokens was drawn at a version >= v - k (episodes: the observation
tokens between turns were not sampled and do not count). Its staleness is v - (its oldest sampled token's
version); k = 0 is on-policy.

The filter works on whole groups (a group's advantage needs all of its samples): a group with one sample past
the bound is dropped as a whole; the trainer refills it (see `trainers.rl.async_rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.rollout.batch import RolloutBatch


def oldest_token_versions(batch: RolloutBatch) -> list[int]:
    """Per sample: the oldest version among its sampled tokens (episodes: mask 1 only); a sample with none holds
    its `policy_versions` entry (the version its request started under)."""
    out = []
    for b, versions in enumerate(batch.token_versions or [[] for _ in range(batch.num_samples)]):
        if batch.completion_mask is not None:
            versions = [v for v, sampled in zip(versions, batch.completion_mask[b]) if sampled]
        out.append(min(versions) if versions else batch.policy_versions[b])
    return out


@dataclass(frozen=True)
class StalenessSplit:
    """Which groups of a batch the update at `version` may use under the bound `max_staleness`."""

    version: int
    max_staleness: int
    group_size: int
    fresh_groups: list[int]  # group indices within the bound, in order
    stale_groups: list[int]  # group indices with a sample past it
    staleness: list[int]  # per sample of the batch: version - its oldest sampled token's version

    @property
    def used_staleness(self) -> list[int]:
        """The staleness of every sample of the fresh groups (what the update uses)."""
        G = self.group_size
        return [self.staleness[g * G + j] for g in self.fresh_groups for j in range(G)]


def split_stale(batch: RolloutBatch, version: int, max_staleness: int) -> StalenessSplit:
    """Split `batch`'s groups into those usable at `version` (every sampled token at >= version - max_staleness)
    and the stale ones."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    staleness = [version - oldest for oldest in oldest_token_versions(batch)]
    G = batch.group_size
    fresh, stale = [], []
    for g in range(batch.num_groups):
        worst = max(staleness[g * G : (g + 1) * G])
        (stale if worst > max_staleness else fresh).append(g)
    return StalenessSplit(version, max_staleness, G, fresh, stale, staleness)


def staleness_metrics(used: list[int], max_staleness: int, dropped_samples: int) -> dict[str, float]:
    """The staleness histogram of the samples used (`async/staleness_<i>`: how many were i versions old, for
    i = 0..max_staleness), their mean and max, and the samples dropped as stale."""
    metrics: dict[str, float] = {
        f"async/staleness_{i}": float(sum(s == i for s in used)) for i in range(max_staleness + 1)
    }
    metrics["async/staleness_mean"] = sum(used) / len(used) if used else 0.0
    metrics["async/staleness_max"] = float(max(used, default=0))
    metrics["async/stale_dropped"] = float(dropped_samples)
    return metrics

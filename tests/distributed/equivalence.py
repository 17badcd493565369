"""Two runs of one training (2 processes against 1, or a resumed run against the run it resumed) compared step by
step and weight by weight, within the bounds tests/numeric.py derives.

What each metric can promise depends on how many AdamW updates came before it:
- none: the runs computed it from the same weights and data in another summation order, so every metric
  (loss, gradient norm, KL, rewards, ...) agrees to `reorder_close`;
- some: the weights are up to `adam_drift` apart. The loss then agrees to first order in that drift (its own
  gradient's norm is logged beside it); for the others (the gradient norm: curvature times drift) nothing
  logged bounds the difference, so they are compared before the first update only;
- metrics of the sampled completions (rewards, lengths, token counts) come from the same tokens as long as the
  drift flips no sampled token (a uniform draw landing within ~drift of a token's boundary in the cumulative
  distribution), so they agree to `reorder_close` at every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tests.distributed.launch import max_difference
from tests.numeric import adam_drift, loss_after_updates_tolerance, reorder_close


def assert_same_steps(
    got: list[dict],
    want: list[dict],
    *,
    lr: float,
    eps: float,
    compared: Iterable[str] = (),
    sampled: Iterable[str] = (),
    updates_per_step: int = 1,
    updates_before: int = 0,
    max_grad_norm: float = 1.0,
) -> None:
    """The records of `got` equal those of `want` step for step: "loss" always, `compared` (e.g. grad_norm, kl) where
    no update came before them, `sampled` always. updates_per_step: optimizer steps a record spans (PPO's
    minibatches, whose later losses follow the earlier updates); updates_before: the updates before the first
    record (a resumed run's)."""
    compared, sampled = tuple(compared), tuple(sampled)
    assert [r["step"] for r in got] == [r["step"] for r in want], "the runs logged other steps"
    for index, (mine, theirs) in enumerate(zip(got, want)):
        updates = updates_before + index * updates_per_step + updates_per_step - 1  # before the record's last loss
        where = (theirs["step"], updates)
        for key in sampled:
            assert reorder_close(mine[key], theirs[key]), (*where, key, mine[key], theirs[key])
        if updates == 0:
            for key in ("loss", *compared):
                assert reorder_close(mine[key], theirs[key]), (*where, key, mine[key], theirs[key])
        else:
            bound = loss_after_updates_tolerance(
                theirs["loss"], theirs["grad_norm"], adam_drift(lr, updates, eps, max_grad_norm)
            )
            assert abs(mine["loss"] - theirs["loss"]) <= bound, (*where, "loss", mine["loss"], theirs["loss"], bound)


def assert_same_weights(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    lr: float,
    eps: float,
    updates: int,
    max_grad_norm: float = 1.0,
) -> None:
    """Weights (same names) the runs hold after `updates` AdamW updates from the same start: within `adam_drift`."""
    bound = adam_drift(lr, updates, eps, max_grad_norm)
    difference = max_difference(got, want)
    assert difference <= bound, f"weights {difference:.3g} apart after {updates} updates, bound {bound:.3g}"

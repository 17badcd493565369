"""Leave groups whose advantages are all zero out of the update's forward and backward.

With an outcome advantage (GRPO, Dr.GRPO, DAPO, GSPO, RLOO) a group whose G rewards are all equal
(every sample right, or every sample wrong) gets advantage 0 for each of its samples. When the loss
has no other term (no KL loss, no entropy bonus, no value loss, no router loss) such a sample's loss
is 0 * ratio terms and its gradient is exactly zero: computing it is pure waste. Late in a run most
groups are like that (the demo's `zero_variance_frac` sits at 0.6-0.9 after its first dozen steps).

Skipping them changes nothing else: the loss normalisers (tokens / sequences of the minibatch) are
still counted over every sample, micro-batch and minibatch boundaries stay where they were, so the
gradient equals the unskipped one up to summation order, and so do the logged losses (`loss`,
`loss/policy`: sums of micro-batch terms, to which a skipped group adds 0). Only the diagnostics computed
inside the update (entropy, clip fractions, trainer-engine mismatch) then cover the samples that train.

Under torchrun a micro-batch is never dropped whole (it keeps its first group): every rank must run
the same number of forward / backward passes for the collectives to line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.trainers.packed_groups import PackedGroups


@dataclass
class TrainedPack:
    """One micro-batch as the update runs it: `pack` over the groups that train (None: skip it), and the
    rows (samples of the step's batch) that pack's outputs belong to, in the pack's sample order."""

    pack: PackedGroups | None
    rows: slice | Tensor  # slice when nothing was dropped, else a (b,) index tensor
    skipped_groups: int


def zero_advantage_is_free(
    adv: Tensor, *, kl_loss: bool, entropy_coef: float, value_head: bool, router_loss: bool
) -> bool:
    """Whether a zero-advantage sample contributes exactly nothing to the loss's gradient."""
    return adv.dim() == 1 and not kl_loss and entropy_coef == 0 and not value_head and not router_loss


def trained_packs(
    packs: list[PackedGroups], slices: list[slice], adv: Tensor, group_size: int, keep_one: bool
) -> list[TrainedPack]:
    """Each micro-batch with its all-zero-advantage groups taken out (adv (B,), one value per sample), cut
    out of its pack (`PackedGroups.select`).

    keep_one: never leave a micro-batch empty (torchrun: collectives need every rank's passes).
    """
    G = group_size
    live = (adv.view(-1, G) != 0).any(dim=1).tolist()  # (num_groups,) does the group carry any signal
    out = []
    for pack, rows in zip(packs, slices):
        first, last = rows.start // G, rows.stop // G
        kept = [g for g in range(first, last) if live[g]]
        if len(kept) == last - first:
            out.append(TrainedPack(pack, rows, 0))
            continue
        if not kept and keep_one:
            kept = [first]
        if not kept:
            out.append(TrainedPack(None, rows, last - first))
            continue
        trimmed = pack.select([g - first for g in kept])
        device = pack.input_ids.device
        index = torch.tensor([g * G + j for g in kept for j in range(G)], dtype=torch.long, device=device)
        out.append(TrainedPack(trimmed, index, last - first - len(kept)))
    return out

"""Rows -> tensors: right padding for plain rows, segment ids for packed rows.

Targets are next-token ids already shifted, *within each sequence*: targets[t] is the label of
token t+1 of the same sequence, -100 at a sequence's last token, on prompt tokens and on padding.
A loss is then a plain cross-entropy of position t's logits against targets[t], and no target ever
crosses from one packed sequence into the next.

Right padding needs no attention mask: under causal attention a real token only sees earlier
tokens, which are all real, so `model_kwargs()` leaves the mask out and the model takes its fast
causal path. Pad positions produce garbage that no target reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from posttrain.data.packing import PackedRow
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    targets: torch.Tensor  # (B, T) long, next-token ids or -100
    attention_mask: torch.Tensor  # (B, T) long, 1 real / 0 padding
    segment_ids: torch.Tensor | None  # (B, T) long for packed rows (0 on padding), else None
    num_tokens: int  # real tokens, padding excluded
    num_targets: int  # positions with a target (the loss's token count)

    def to(self, device: torch.device | str) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return replace(
            self,
            input_ids=move(self.input_ids),
            targets=move(self.targets),
            attention_mask=move(self.attention_mask),
            segment_ids=move(self.segment_ids),
        )

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `Transformer.hidden_states` besides the ids (see the module docstring)."""
        return {} if self.segment_ids is None else {"segment_ids": self.segment_ids}


def shifted_targets(labels: Sequence[int], seq_lengths: Sequence[int]) -> list[int]:
    """Per sequence: targets[t] = labels[t + 1], and -100 at each sequence's last position."""
    targets: list[int] = []
    start = 0
    for length in seq_lengths:
        targets += labels[start + 1 : start + length]
        targets.append(IGNORE_INDEX)
        start += length
    return targets


def collate(rows: Sequence[TokenizedRow | PackedRow], pad_token_id: int, pad_to_multiple_of: int = 1) -> Batch:
    """Right-pad `rows` to the longest (rounded up to `pad_to_multiple_of`). Packed rows get segment ids."""
    if not rows:
        raise ValueError("cannot collate an empty batch")
    packed = any(isinstance(row, PackedRow) for row in rows)
    longest = max(len(row) for row in rows)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    segment_ids = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    for b, row in enumerate(rows):
        lengths = row.seq_lengths if isinstance(row, PackedRow) else [len(row)]
        n = len(row)
        input_ids[b, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        targets[b, :n] = torch.tensor(shifted_targets(row.labels, lengths), dtype=torch.long)
        attention_mask[b, :n] = 1
        if segment_ids is not None:
            segment_ids[b, :n] = torch.repeat_interleave(
                torch.arange(1, len(lengths) + 1), torch.tensor(lengths, dtype=torch.long)
            )
    num_targets = int((targets != IGNORE_INDEX).sum())
    return Batch(input_ids, targets, attention_mask, segment_ids, int(attention_mask.sum()), num_targets)


def length_groups(lengths: Sequence[int], group_cost_tokens: int) -> list[list[int]]:
    """Split one batch into sub-batches of similar length, to pad less: index lists, longest first.

    Rows sorted by length are cut into contiguous groups minimising
        sum over groups of (rows in group x longest row in group)  +  group_cost_tokens x groups,
    i.e. padded tokens computed plus a price, in tokens, for each extra forward/backward pass
    (exact dynamic programme, O(n^2) for n rows). The gradient is the same whatever the split,
    as long as the caller divides every group's summed loss by the batch's total (see
    `posttrain.trainers.accumulate`). A large cost gives one group: plain padding.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[k]: cost of the first k sorted rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):  # group = sorted rows start..end-1; its longest is order[start]
            cost = best[start] + (end - start) * lengths[order[start]] + group_cost_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]

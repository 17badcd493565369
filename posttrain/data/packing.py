"""Packing: many short sequences into rows of at most `max_length` tokens, kept apart by segments.

Best-fit decreasing: take sequences longest first and put each into the open row with the least
room that still fits it, opening a new row when none does. Rows come out nearly full (padding is
what is left of the last few rows) and no sequence is ever split, so every packed sequence trains
exactly as it would alone: the collator gives each one its own `segment_ids`, attention stays
inside a segment and positions restart at 0 (tested against unpacked per-sequence losses).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.data.tokenize import TokenizedRow


@dataclass
class PackedRow:
    """Several sequences back to back; seq_lengths says where each ends."""

    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def pack_best_fit(rows: Sequence[TokenizedRow], max_length: int) -> list[PackedRow]:
    """Pack `rows` (each at most max_length long) into as few rows as best-fit decreasing finds."""
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]), reverse=True)  # stable: ties keep file order
    bins: list[list[int]] = []  # row indices per packed row
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted: bisect finds the tightest fit
    for i in order:
        length = len(rows[i])
        if length > max_length:
            raise ValueError(f"sequence {i} has {length} tokens, more than max_length {max_length}")
        if length == 0:
            continue
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):
            bins.append([i])
            room, index = max_length - length, len(bins) - 1
        else:
            room, index = free.pop(slot)
            bins[index].append(i)
            room -= length
        if room > 0:
            bisect.insort(free, (room, index))
    return [_concat([rows[i] for i in members]) for members in bins]


def _concat(rows: Sequence[TokenizedRow]) -> PackedRow:
    input_ids: list[int] = []
    labels: list[int] = []
    for row in rows:
        input_ids += row.input_ids
        labels += row.labels
    return PackedRow(input_ids, labels, [len(row) for row in rows])

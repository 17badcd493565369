"""Packing and collation: best-fit packing, per-sequence targets, and packed loss == unpacked loss."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.data.collate import collate, shifted_targets
from posttrain.data.packing import pack_best_fit
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.trainers.sft import sft_loss_sum
from tests.data.tiny import VOCAB_SIZE, tiny_model

I = IGNORE_INDEX


def random_rows(n: int, seed: int = 0, max_len: int = 40) -> list[TokenizedRow]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(3, max_len)
        ids = [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]
        prompt = rng.randint(1, length - 2)
        rows.append(TokenizedRow(ids, [I] * prompt + ids[prompt:]))
    return rows


def test_best_fit_packs_every_sequence_once_within_max_length():
    rows = random_rows(200)
    packed = pack_best_fit(rows, 64)
    assert all(len(p) <= 64 and sum(p.seq_lengths) == len(p) for p in packed)
    assert sorted(tuple(r.input_ids) for r in rows) == sorted(
        tuple(p.input_ids[s - n : s]) for p in packed for s, n in zip(_ends(p.seq_lengths), p.seq_lengths)
    )
    total = sum(len(r) for r in rows)
    assert len(packed) <= -(-total // 64) + 2  # within two rows of the lower bound


def _ends(lengths):
    out, acc = [], 0
    for n in lengths:
        acc += n
        out.append(acc)
    return out


def test_best_fit_choice_is_the_tightest_bin():
    rows = [TokenizedRow([5] * n, [5] * n) for n in (6, 5, 4, 3)]
    packed = pack_best_fit(rows, 10)
    assert [p.seq_lengths for p in packed] == [[6, 4], [5, 3]]  # 4 goes to room 4 (not 5); 3 to room 5
    with pytest.raises(ValueError, match="more than max_length"):
        pack_best_fit([TokenizedRow([1] * 11, [1] * 11)], 10)


def test_targets_shift_within_each_sequence():
    assert shifted_targets([I, 7, 8, I, 9, 10], [3, 3]) == [7, 8, I, 9, 10, I]
    rows = [TokenizedRow([1, 2, 3], [I, 2, 3]), TokenizedRow([4, 5], [I, 5])]
    padded = collate(rows, pad_token_id=0)
    assert padded.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert padded.targets.tolist() == [[2, 3, I], [5, I, I]]
    assert padded.segment_ids is None and padded.model_kwargs() == {}
    assert (padded.num_tokens, padded.num_targets) == (5, 3)
    packed = collate(pack_best_fit(rows, 8), pad_token_id=0, pad_to_multiple_of=8)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert packed.targets.tolist() == [[2, 3, I, 5, I, I, I, I]]
    assert packed.segment_ids.tolist() == [[1, 1, 1, 2, 2, 0, 0, 0]]


def test_packed_loss_equals_unpacked_per_sequence_loss():
    torch.manual_seed(0)
    model = tiny_model().eval()
    rows = random_rows(12, seed=1)
    packed = pack_best_fit(rows, 96)
    assert len(packed) < len(rows) and any(len(p.seq_lengths) > 2 for p in packed)
    with torch.no_grad():
        alone = sum(float(sft_loss_sum(model, collate([row], 0))) for row in rows)
        padded = float(sft_loss_sum(model, collate(rows, 0)))
        together = float(sft_loss_sum(model, collate(packed, 0)))
    assert together == pytest.approx(alone, rel=1e-5)
    assert padded == pytest.approx(alone, rel=1e-5)


def test_length_groups_trade_padding_for_passes():
    from posttrain.data.collate import length_groups

    lengths = [132, 132, 196, 218, 136, 265, 184, 256]
    assert length_groups(lengths, 10_000) == [[5, 7, 3, 2, 6, 4, 0, 1]]  # one padded batch, longest first
    assert [[lengths[i] for i in g] for g in length_groups(lengths, 64)] == [
        [265, 256],
        [218, 196, 184],
        [136, 132, 132],
    ]
    assert sorted(i for g in length_groups(lengths, 0) for i in g) == list(range(8))


def test_grouped_sub_batches_give_the_same_loss():
    from posttrain.trainers.sft import grouped_batches

    model = tiny_model().eval()
    rows = random_rows(10, seed=3)
    with torch.no_grad():
        whole = float(sft_loss_sum(model, collate(rows, 0)))
        groups = grouped_batches(rows, 0, group_cost_tokens=8, device=torch.device("cpu"))
        assert len(groups) > 2
        split = sum(float(sft_loss_sum(model, b)) for b in groups)
    assert split == pytest.approx(whole, rel=1e-5)

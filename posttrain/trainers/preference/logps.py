"""Sequence log-probabilities of tokenized rows: the sums of their completion tokens' log-probs, the
quantity every preference loss compares (the LM head applied only at completion positions).

A pair's chosen and rejected rows nearly always start with the same prompt (on the HH-RLHF harmless
pairs the prompt is ~74% of their tokens). Such a pair goes through the model as ONE packed row, the
prompt once and each completion attending to the prompt and to itself only (posttrain.trainers.packed_groups):
the same log-probs as two rows, on ~40% fewer tokens here, and rows of similar length pad less.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.algos.logprobs import token_logprobs
from posttrain.data.collate import Batch, collate
from posttrain.data.preference_pairs import PairRow
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.models.transformer import Transformer
from posttrain.trainers.packed_groups import PackedGroups, pack_groups, packed_forward

PairInputs = Batch | PackedGroups  # a micro-batch of pairs, as `collate_pairs` makes it


def shares_prompt(pair: PairRow) -> bool:
    """Whether chosen and rejected start with the same prompt (the tokens without a label) and every token after
    it is scored: then the pair packs into one row of a prompt and two completions."""
    prompt = pair.prompt_length
    rows = (pair.chosen, pair.rejected)
    return (
        prompt > 0
        and all(len(row) > prompt and row.input_ids[:prompt] == pair.chosen.input_ids[:prompt] for row in rows)
        and all(row.labels[:prompt] == [IGNORE_INDEX] * prompt for row in rows)
        and all(row.labels[prompt:] == row.input_ids[prompt:] for row in rows)
    )


def packed_length(pair: PairRow) -> int:
    """Tokens the pair puts through the model: one packed row when it shares its prompt, else two rows."""
    if shares_prompt(pair):
        return len(pair.chosen) + len(pair.rejected) - pair.prompt_length - 2  # last tokens are not inputs
    return len(pair.chosen) + len(pair.rejected)


def collate_pairs(pairs: Sequence[PairRow], pad_token_id: int, device: torch.device | str = "cpu") -> PairInputs:
    """One packed row per pair when every pair shares its prompt (PackedGroups, samples chosen_0, rejected_0,
    chosen_1, ...); else 2B right-padded rows, the chosen sequences then the rejected ones (Batch)."""
    if all(shares_prompt(p) for p in pairs):
        prompts = [p.chosen.input_ids[: p.prompt_length] for p in pairs]
        completions = [[row.input_ids[p.prompt_length :] for row in (p.chosen, p.rejected)] for p in pairs]
        return pack_groups(prompts, completions, device)
    return collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_token_id).to(device)


def pair_logps(model: Transformer, batch: PairInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion logps (2B,) float32, completion tokens (2B,) long): the B chosen rows, then the B
    rejected ones, whichever way `collate_pairs` laid the pairs out."""
    if isinstance(batch, Batch):
        return sequence_logps(model, batch)
    per_token = packed_forward(model, batch, 1.0).logprobs  # (2B, L), 0 outside the completions
    sums, lengths = per_token.sum(1), batch.completion_mask.sum(1).long()  # (2B,) pair by pair
    return torch.cat([sums[0::2], sums[1::2]]), torch.cat([lengths[0::2], lengths[1::2]])


def sequence_logps(model: Transformer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of completion-token logps (R,) float32, completion tokens (R,) long) for each row.

    The LM head runs on completion positions only: (N, V) logits for the N targets of the batch.
    """
    hidden = model.hidden_states(batch.input_ids, **batch.model_kwargs())  # (R, T, d)
    keep = batch.targets != IGNORE_INDEX  # (R, T)
    logits = model.logits(hidden[keep])  # (N, V) fp32
    per_token = token_logprobs(logits[None], batch.targets[keep][None])[0]  # (N,)
    rows = keep.nonzero()[:, 0]  # (N,) row of each target
    logps = torch.zeros(keep.shape[0], dtype=per_token.dtype, device=per_token.device).index_add(0, rows, per_token)
    return logps, keep.sum(1)  # (R,), (R,)


def batches_by_length(pairs: Sequence[PairRow], batch_size: int) -> list[list[int]]:
    """Indices of `pairs` in batches of `batch_size`, shortest first: a pass over all of them (the reference
    table, an evaluation) pads little. Each pair's logps do not depend on the batch it is in."""
    order = sorted(range(len(pairs)), key=lambda i: packed_length(pairs[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def by_length(micro_batches: list[list[int]], pairs: Sequence[PairRow]) -> list[list[int]]:
    """The pairs of one step's micro-batches, dealt out again in order of length into micro-batches of the
    same sizes: the step's gradient is a sum over its pairs, so only the padding changes."""
    ordered = sorted((i for batch in micro_batches for i in batch), key=lambda i: packed_length(pairs[i]))
    out, start = [], 0
    for batch in micro_batches:
        out.append(ordered[start : start + len(batch)])
        start += len(batch)
    return out


@torch.no_grad()
def frozen_pair_logps(
    model: Transformer, pairs: Sequence[PairRow], batch_size: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (n,), rejected (n,)) summed completion logps of `pairs` under `model`, without gradients, on CPU."""
    chosen, rejected = torch.zeros(len(pairs)), torch.zeros(len(pairs))
    for idx in batches_by_length(pairs, batch_size):
        logps = pair_logps(model, collate_pairs([pairs[i] for i in idx], pad_token_id, model.device))[0].cpu()
        chosen[idx], rejected[idx] = logps[: len(idx)], logps[len(idx) :]
    return chosen, rejected


@torch.no_grad()
def frozen_logps(model: Transformer, rows: Sequence[TokenizedRow], batch_size: int, pad_token_id: int) -> torch.Tensor:
    """Summed completion logps of `rows` under `model`, without gradients: (len(rows),) on CPU."""
    out = []
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad_token_id).to(model.device)
        out.append(sequence_logps(model, batch)[0].cpu())
    return torch.cat(out) if out else torch.zeros(0)

"""Sequence log-probabilities of tokenized rows: the sums of their completion tokens' log-probs, the
quantity every preference loss compares (the LM head applied only at completion positions)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.algos.logprobs import token_logprobs
from posttrain.data.collate import Batch, collate
from posttrain.data.preference_pairs import PairRow
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.models.transformer import Transformer


def collate_pairs(pairs: Sequence[PairRow], pad_token_id: int) -> Batch:
    """2B rows: the chosen sequences of `pairs`, then their rejected sequences."""
    return collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_token_id)


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


@torch.no_grad()
def frozen_logps(model: Transformer, rows: Sequence[TokenizedRow], batch_size: int, pad_token_id: int) -> torch.Tensor:
    """Summed completion logps of `rows` under `model`, without gradients: (len(rows),) on CPU."""
    out = []
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad_token_id).to(model.device)
        out.append(sequence_logps(model, batch)[0].cpu())
    return torch.cat(out) if out else torch.zeros(0)

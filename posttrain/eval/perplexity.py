"""Perplexity of a model on held-out text: exp(mean negative log-likelihood per token).

Each row is tokenized on its own (with the tokenizer's special tokens, e.g. a BOS), cut to `max_length`
tokens, and every token after the first is scored given the ones before it. The mean runs over all scored
tokens of all rows (rows weigh by their length), so ppl = exp(sum NLL / number of scored tokens).

Rows are batched by length (longest first) and right-padded: under a causal mask a real token never sees
the padding after it, so no attention mask is needed and the result does not depend on the batch size
beyond float rounding. Logits are made in chunks of positions, so memory stays at (chunk, vocab).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from posttrain.data.readers import read_rows, row_location
from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError

LOGIT_CHUNK = 2048  # positions per lm_head call: (2048, vocab) fp32 is 400 MB at a 49k vocabulary


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    tokens: int  # scored tokens (each row's length minus one)
    rows: int
    truncated_rows: int  # rows longer than max_length, cut

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_texts(path: str | Path, column: str, skip: int = 0, max_rows: int | None = None) -> list[str]:
    """The `column` of rows skip+1 .. skip+max_rows of a dataset file, each checked to be a string."""
    if skip < 0 or (max_rows is not None and max_rows <= 0):
        raise PosttrainError(f"skip must be >= 0 and max_rows > 0 (got skip={skip}, max_rows={max_rows})")
    texts: list[str] = []
    for index, (n, row) in enumerate(read_rows(path)):
        if index < skip:
            continue
        if max_rows is not None and len(texts) >= max_rows:
            break
        if column not in row:
            raise DataError(f"{row_location(path, n)}: no column {column!r} (columns: {', '.join(row)})")
        value = row[column]
        if not isinstance(value, str):
            raise DataError(f"{row_location(path, n)}: column {column!r} is {type(value).__name__}, expected text")
        texts.append(value)
    if not texts:
        raise DataError(f"{path}: no rows to score (skip={skip}, the file has fewer rows)")
    return texts


def tokenize_texts(tokenizer: Any, texts: Sequence[str], max_length: int) -> tuple[list[list[int]], int]:
    """(token ids per row, cut to max_length; number of rows that were cut)."""
    if max_length < 2:
        raise PosttrainError(f"max_length must be >= 2 (one token to condition on, one to score), got {max_length}")
    rows = tokenizer.encode_batch(list(texts), add_special_tokens=True)
    truncated = sum(len(ids) > max_length for ids in rows)
    return [ids[:max_length] for ids in rows], truncated


@torch.no_grad()
def sum_nll(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[float, int]:
    """Right-padded ids (B, T) with real lengths (B,) -> (sum of NLL over scored tokens, number scored)."""
    T = ids.shape[1]
    hidden = model.hidden_states(ids)  # (B, T, d); causal, so padding after a row changes nothing before it
    scored = torch.arange(T - 1, device=ids.device)[None, :] < (lengths[:, None] - 1)  # (B, T-1)
    h = hidden[:, :-1][scored]  # (n, d): positions that predict a real next token
    targets = ids[:, 1:][scored]  # (n,)
    total = 0.0
    for start in range(0, h.shape[0], LOGIT_CHUNK):
        logits = model.logits(h[start:start + LOGIT_CHUNK])  # (chunk, V) fp32
        total += F.cross_entropy(logits, targets[start:start + LOGIT_CHUNK], reduction="sum").item()
    return total, int(targets.numel())


def perplexity(
    model: torch.nn.Module, token_rows: Sequence[Sequence[int]], batch_size: int = 8, progress: bool = False,
    truncated_rows: int = 0,
) -> PerplexityResult:
    """Perplexity over tokenized rows (see the module docstring for what is scored)."""
    if batch_size < 1:
        raise PosttrainError(f"batch_size must be >= 1, got {batch_size}")
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    order = sorted(range(len(token_rows)), key=lambda i: -len(token_rows[i]))
    total_nll, total_tokens = 0.0, 0
    with tqdm(total=len(order), desc="perplexity", unit="row", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(order), batch_size):
            batch = [token_rows[i] for i in order[start:start + batch_size]]
            lengths = torch.tensor([len(r) for r in batch], device=device)
            if int(lengths.max()) >= 2:
                ids = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long, device=device)  # (B, T)
                for b, row in enumerate(batch):
                    ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
                nll, n = sum_nll(model, ids, lengths)
                total_nll, total_tokens = total_nll + nll, total_tokens + n
            bar.update(len(batch))
            if total_tokens:
                bar.set_postfix(ppl=f"{math.exp(total_nll / total_tokens):.3f}")
    if total_tokens == 0:
        raise PosttrainError("no tokens to score: every row has fewer than 2 tokens")
    mean = total_nll / total_tokens
    return PerplexityResult(math.exp(mean), mean, total_tokens, len(token_rows), truncated_rows)


def evaluate_perplexity(
    model: torch.nn.Module, tokenizer: Any, path: str | Path, column: str = "text", skip: int = 0,
    max_rows: int | None = None, max_length: int = 1024, batch_size: int = 8, progress: bool = False,
) -> PerplexityResult:
    """Read a column of a dataset file, tokenize it and score it."""
    texts = read_texts(path, column, skip, max_rows)
    rows, truncated = tokenize_texts(tokenizer, texts, max_length)
    return perplexity(model, rows, batch_size, progress, truncated)

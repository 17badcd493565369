"""Perplexity of a model on held-out text: exp(mean negative log-likelihood per token).

Each row is tokenized on its own (with the tokenizer's special tokens, e.g. a BOS), cut to `max_length`
tokens, and every token after the first is scored given the ones before it. The mean runs over all scored
tokens of all rows (rows weigh by their length), so ppl = exp(sum NLL / number of scored tokens).

The rows go through the rollout engine as prefill-only requests asking for their prompt logprobs
(eval/scoring.py): continuously batched without padding, the LM head run in bounded chunks of positions,
and the same numbers as a dense forward pass (to float rounding; the batch size does not change them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.data.readers import read_rows, row_location
from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError
from posttrain.eval.scoring import token_logprobs


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


def perplexity(
    model: torch.nn.Module,
    token_rows: Sequence[Sequence[int]],
    batch_size: int = 8,
    progress: bool = False,
    truncated_rows: int = 0,
) -> PerplexityResult:
    """Perplexity over tokenized rows (see the module docstring for what is scored). `batch_size`: rows
    prefilled together by the engine."""
    if batch_size < 1:
        raise PosttrainError(f"batch_size must be >= 1, got {batch_size}")
    if all(len(row) < 2 for row in token_rows):
        raise PosttrainError("no tokens to score: every row has fewer than 2 tokens")
    per_token = token_logprobs(model, token_rows, batch_size, progress)  # per row: len - 1 logprobs
    total_tokens = sum(len(row) for row in per_token)
    mean = -math.fsum(logprob for row in per_token for logprob in row) / total_tokens
    return PerplexityResult(math.exp(mean), mean, total_tokens, len(token_rows), truncated_rows)


def evaluate_perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    path: str | Path,
    column: str = "text",
    skip: int = 0,
    max_rows: int | None = None,
    max_length: int = 1024,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Read a column of a dataset file, tokenize it and score it."""
    texts = read_texts(path, column, skip, max_rows)
    rows, truncated = tokenize_texts(tokenizer, texts, max_length)
    return perplexity(model, rows, batch_size, progress, truncated)

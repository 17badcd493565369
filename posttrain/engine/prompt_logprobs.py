"""Prompt logprobs (`SamplingParams.prompt_logprobs`): how likely the model finds each prompt token.

The distribution is the model's RAW one: entry t is `log_softmax(z_{t-1})[prompt[t]]` over the full
vocabulary, where `z_{t-1}` are the logits at position t - 1 (which predict token t), with no
temperature, no penalties and no min_tokens mask. That is what perplexity, DPO's implicit reward and
reward scoring recompute from a dense forward pass. Token 0 has no entry (nothing predicts it): the
request output shows None there, as vLLM does. `SamplingParams.prompt_logprobs_from = s` starts the entries at
token s (None before it): then positions before s - 1 need no logits, so their K/V may come from the prefix
cache (the shared prompt of a chosen / rejected pair) and the LM head skips them.

The prompt is prefilled in chunks; each chunk's positions that still lack a logprob are projected
through the LM head and their logprobs appended, so the entries arrive in order, once each:
- a sequence preempted mid-prefill recomputes its K/V from the start but adds only positions past
  what it already has;
- a cached prefix block skips its forward pass and so its logits: a request takes prefix-cache hits
  only over positions whose logprobs it already holds (none, at first admission);
- with n > 1 only the request's first sequence computes them, before it forks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Hidden rows per LM-head call: the (rows, V) fp32 logits and the logsumexp temporary are the largest
# tensors made here, ~100 MB each at a 49k vocabulary, whatever the prompt length.
LOGIT_CHUNK = 512
RANK_CHUNK = 32  # rows per rank count: its (rows, V) comparison stays a few MB (a whole chunk's would be 200 MB)


@dataclass
class PromptLogprobChunk:
    """One step's new entries for one sequence: logprobs[i] and top[i] belong to the same prompt token."""

    logprobs: list[float]
    ranks: list[int] | None  # of each prompt token among the vocabulary by logit, 1 = the most likely; if asked
    top: list[list[tuple[int, float]]] | None  # k (token, logprob) per entry, most likely first; None when k = 0


class PromptLogprobs:
    """The prompt logprobs of one request, filled chunk by chunk as its prompt is prefilled.

    Position p's logits predict prompt token p + 1, so positions 0 .. P-2 each give one entry; the last
    prompt position predicts the first generated token instead.
    """

    def __init__(self, num_prompt_tokens: int, num_top: int, first_token: int = 1, with_ranks: bool = False) -> None:
        self.num_positions = num_prompt_tokens - 1
        self.num_skipped = min(first_token - 1, self.num_positions)  # leading positions that give no entry
        self.num_top = num_top
        self.with_ranks = with_ranks
        self.logprobs: list[float] = []  # entry i: prompt token i + 1
        self.ranks: list[int] = []
        self.top: list[list[tuple[int, float]]] = []

    @property
    def num_known(self) -> int:
        """Leading positions whose logprob is known or not wanted (so their K/V may come from the prefix cache)."""
        return self.num_skipped + len(self.logprobs)

    @property
    def done(self) -> bool:
        return self.num_known == self.num_positions

    def positions_to_compute(self, start: int, end: int) -> range:
        """The positions of a chunk [start, end) whose logits give an entry not known yet."""
        return range(max(start, self.num_known), min(end, self.num_positions))

    def add(self, chunk: PromptLogprobChunk) -> None:
        self.logprobs.extend(chunk.logprobs)
        if chunk.ranks is not None:
            self.ranks.extend(chunk.ranks)
        if chunk.top is not None:
            self.top.extend(chunk.top)

    def entries(self) -> list[float | None]:
        """One per prompt token: None for the first (and those before `first_token`), then each token's logprob."""
        return self._aligned(self.logprobs)

    def rank_entries(self) -> list[int | None] | None:
        """One per prompt token, as entries(): each token's rank (1 = the most likely); None unless asked for."""
        return self._aligned(self.ranks) if self.with_ranks else None

    def top_entries(self) -> list[list[tuple[int, float]] | None] | None:
        """One per prompt token (None where entries() has None), or None when the request asked for no alternatives."""
        return self._aligned(self.top) if self.num_top else None

    def _aligned(self, values: list) -> list:
        """values (one per computed entry) behind a None for each prompt token that has none: one per token."""
        return [None] * (1 + self.num_skipped) + values


@torch.inference_mode()
def token_logprobs_and_top(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    with_ranks: bool = False,
    chunk: int = LOGIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """log_softmax(model.logits(hidden))[targets], the targets' ranks if asked for (1 + the number of tokens
    with a larger logit: one more pass over the logits, about 40% of the LM head's time) and the num_top
    largest log-probabilities, made chunk by chunk of rows so no more than (chunk, V) fp32 logits exist at once.
    hidden (M, d), targets (M,) -> logprobs (M,) fp32, ranks (M,) int64 or None, top values (M, k) fp32,
    top ids (M, k)."""
    vocab_size = model.config.vocab_size
    k = min(num_top, vocab_size)
    logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (M,)
    ranks = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device) if with_ranks else None  # (M,)
    top_values = torch.empty(hidden.shape[0], k, dtype=torch.float32, device=hidden.device)  # (M, k)
    top_ids = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)  # (M, k)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = model.logits(hidden[rows])  # (c, V) fp32
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (c, 1)
        target_logits = logits.gather(1, targets[rows, None])  # (c, 1)
        logprobs[rows] = (target_logits - lse).squeeze(1)
        if ranks is not None:
            for sub in range(0, logits.shape[0], RANK_CHUNK):
                part = slice(sub, sub + RANK_CHUNK)
                ranks[start + sub : start + sub + RANK_CHUNK] = (
                    torch.count_nonzero(logits[part] > target_logits[part], dim=-1) + 1
                )
        if k:
            values, ids = logits.topk(k, dim=-1)  # (c, k): the logit order is the log-softmax order
            top_values[rows], top_ids[rows] = values - lse, ids
    return logprobs, ranks, top_values, top_ids


def split_by_sequence(
    logprobs: torch.Tensor,
    ranks: torch.Tensor | None,
    top_values: torch.Tensor,
    top_ids: torch.Tensor,
    counts: list[int],
    num_tops: list[int],
) -> list[PromptLogprobChunk | None]:
    """Cut the flat results of a step into one chunk per sequence of the batch (None where it has no
    rows). counts[i] rows belong to sequence i, which keeps its own num_tops[i] alternatives."""
    values, rank_values = logprobs.tolist(), ranks.tolist() if ranks is not None else None
    tops = list(zip(top_ids.tolist(), top_values.tolist())) if top_values.shape[1] else []
    chunks: list[PromptLogprobChunk | None] = []
    at = 0
    for count, k in zip(counts, num_tops):
        if not count:
            chunks.append(None)
            continue
        top = [list(zip(ids[:k], vals[:k])) for ids, vals in tops[at : at + count]] if k else None
        chunk_ranks = rank_values[at : at + count] if rank_values is not None else None
        chunks.append(PromptLogprobChunk(values[at : at + count], chunk_ranks, top))
        at += count
    return chunks

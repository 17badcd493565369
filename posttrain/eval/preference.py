"""Pairwise preference accuracy: how often a scorer ranks the chosen completion of a pair above the
rejected one, and by how much (the margin, chosen minus rejected).

Two scorers, each computing what its trainer computes:
- a reward model (`posttrain rm`'s `final/`: HF directory + score.safetensors): the score head on the
  last token of prompt + completion, tokenized with `encode_for_scoring` (what `RewardModelScorer` reads),
  a forward pass of the trainer's own pieces;
- a DPO policy against its reference: the implicit reward beta * (log pi(y|x) - log pi_ref(y|x)), the
  sums of the completion tokens' log-probabilities under the chat template's completion mask (the DPO
  trainer's `sequence_logps`), here taken from the engine's prompt logprobs (eval/scoring.py): each
  sequence is one prefill-only request, continuously batched.

Pairs are read by the data layer the trainers use (`data.preference_pairs.load_pairs`): TRL's explicit (prompt / chosen / rejected)
and implicit (chosen / rejected) preference rows, text or chat messages, and hh-rlhf transcripts.
Bad rows are reported with file:line; above `max_bad_row_fraction` of them the read fails.

Ties count HALF (a pair with |margin| <= tie_tolerance adds 0.5 to the wins), as the trainers' held-out
accuracies do: an untrained DPO policy (all implicit rewards 0) then scores 0.5, not 0. `wins`,
`ties` and `losses` are reported too, so "ties as wrong" is wins / pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.algos.preference import TIE_TOLERANCE
from posttrain.data.config import DataConfig
from posttrain.data.preference_pairs import PairRow, TokenizePair, load_pairs, tokenize_pair_for_policy
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.errors import PosttrainError
from posttrain.eval.scoring import token_logprobs
from posttrain.models.transformer import Transformer
from posttrain.rewards.model_reward import tokenize_pair_for_scoring

CHUNK_PAIRS = 32  # pairs per progress-bar update (each chunk is scored in batches of batch_size)


@dataclass
class PreferenceResult:
    accuracy: float  # (wins + ties / 2) / pairs
    mean_margin: float  # mean of score(chosen) - score(rejected)
    pairs: int
    wins: int  # margin > tie_tolerance
    ties: int  # |margin| <= tie_tolerance
    losses: int
    tie_tolerance: float
    scorer: str  # "reward_model" or "dpo"
    beta: float | None = None  # the DPO implicit reward's beta
    data_report: dict[str, Any] = field(default_factory=dict)  # path, format, rows read, pairs kept, bad rows
    margins: list[float] = field(default_factory=list)  # per pair

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("margins")
        return out


def pairwise_result(
    chosen: torch.Tensor, rejected: torch.Tensor, tie_tolerance: float, scorer: str, data: dict[str, Any] | None = None
) -> PreferenceResult:
    """Accuracy (ties half), mean margin and counts from chosen / rejected scores, each (P,)."""
    if chosen.shape != rejected.shape or chosen.dim() != 1 or chosen.numel() == 0:
        raise PosttrainError(
            f"need two equal-length non-empty score vectors, got {tuple(chosen.shape)} and {tuple(rejected.shape)}"
        )
    margins = chosen.double() - rejected.double()  # (P,)
    wins = int((margins > tie_tolerance).sum())
    ties = int((margins.abs() <= tie_tolerance).sum())
    pairs = margins.numel()
    return PreferenceResult(
        accuracy=(wins + 0.5 * ties) / pairs,
        mean_margin=float(margins.mean()),
        pairs=pairs,
        wins=wins,
        ties=ties,
        losses=pairs - wins - ties,
        tie_tolerance=tie_tolerance,
        scorer=scorer,
        data_report=dict(data or {}),
        margins=margins.tolist(),
    )


def read_pairs(
    path: str | Path, tokenizer: Any, tokenize: TokenizePair, **data_options: Any
) -> tuple[list[PairRow], dict[str, Any]]:
    """Every pair of a preference file, tokenized by `tokenize`; `data_options` are DataConfig fields
    (format, columns, max_rows, max_length, overlong, max_bad_row_fraction, split)."""
    try:
        cfg = DataConfig(path=str(path), **data_options)
        cfg.validate()
    except (TypeError, ValueError) as error:
        raise PosttrainError(f"preference data options: {error}") from None
    data = load_pairs(cfg, tokenizer, seed=0, tokenize=tokenize)
    report = {k: data.report[k] for k in ("path", "format", "rows_read", "pairs_kept")}
    report["bad_rows"] = len(data.report["bad_rows"])
    return data.train, report


def _in_chunks(
    count: int, score: Callable[[slice], tuple[torch.Tensor, torch.Tensor]], progress: bool, desc: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score pairs [0, count) chunk by chunk with a progress bar: (chosen (P,), rejected (P,))."""
    from tqdm.auto import tqdm

    chosen, rejected = [], []
    with tqdm(total=count, desc=desc, unit="pair", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, count, CHUNK_PAIRS):
            c, r = score(slice(start, min(start + CHUNK_PAIRS, count)))
            chosen.append(c)
            rejected.append(r)
            bar.update(c.numel())
    return torch.cat(chosen), torch.cat(rejected)


def evaluate_reward_model(
    reward_model: str | Path | Any,
    data: str | Path,
    *,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str | None = None,
    progress: bool = False,
    tie_tolerance: float = 0.0,
    **data_options: Any,
) -> PreferenceResult:
    """Preference accuracy of a reward model (a directory, or a `RewardModelScorer`) on the pairs of `data`.

    Ties are exact equality by default, as in the reward-model trainer's held-out accuracy."""
    from posttrain.rewards.model_reward import RewardModelScorer

    scorer = (
        reward_model
        if isinstance(reward_model, RewardModelScorer)
        else RewardModelScorer(reward_model, batch_size=batch_size, device=device, dtype=dtype)
    )
    pairs, report = read_pairs(data, scorer.tokenizer, tokenize_pair_for_scoring, **data_options)

    def score(part: slice) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = pairs[part]
        values = scorer.score_ids([p.chosen.input_ids for p in chunk] + [p.rejected.input_ids for p in chunk])
        scores = torch.tensor(values, dtype=torch.float64)  # (2b,) chosen then rejected; no sequence is empty
        return scores[: len(chunk)], scores[len(chunk) :]

    chosen, rejected = _in_chunks(len(pairs), score, progress, "reward model")
    return pairwise_result(chosen, rejected, tie_tolerance, "reward_model", report)


def evaluate_dpo(
    policy: Transformer,
    reference: Transformer,
    tokenizer: Any,
    data: str | Path,
    *,
    beta: float = 0.1,
    batch_size: int = 8,
    progress: bool = False,
    tie_tolerance: float = TIE_TOLERANCE,
    **data_options: Any,
) -> PreferenceResult:
    """Preference accuracy of a DPO policy's implicit reward beta * (logp_policy - logp_ref) on `data`.

    Both models read the same token ids (the policy's tokenizer); ties within TIE_TOLERANCE, as in the
    DPO trainer's held-out `eval_reward_accuracy`."""
    if not beta > 0:
        raise PosttrainError(f"--beta must be > 0, got {beta}")
    if policy.config.vocab_size != reference.config.vocab_size:
        raise PosttrainError(
            f"the policy and the reference have different vocabularies "
            f"({policy.config.vocab_size} vs {reference.config.vocab_size} tokens)"
        )
    pairs, report = read_pairs(data, tokenizer, tokenize_pair_for_policy, **data_options)
    rows, order = rows_in_waves(pairs, batch_size)
    rewards = torch.empty(2 * len(pairs), dtype=torch.float64)  # (2P,) chosen then rejected
    rewards[order] = beta * (
        completion_logps(policy, rows, batch_size, progress) - completion_logps(reference, rows, batch_size, progress)
    )
    chosen, rejected = rewards[: len(pairs)], rewards[len(pairs) :]
    result = pairwise_result(chosen, rejected, tie_tolerance, "dpo", report)
    result.beta = beta
    return result


def rows_in_waves(pairs: Sequence[Any], batch_size: int) -> tuple[list[TokenizedRow], list[int]]:
    """The pairs' rows in scoring order: waves of batch_size chosen rows, each followed by the same pairs'
    rejected rows, which then find their shared prompt in the prefix cache (completion_logps). order[k]: the
    index of row k among all chosen rows followed by all rejected rows."""
    order = [
        i + offset
        for start in range(0, len(pairs), batch_size)
        for offset in (0, len(pairs))
        for i in range(start, min(start + batch_size, len(pairs)))
    ]
    everything = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    return [everything[i] for i in order], order


def completion_logps(
    model: Transformer, rows: Sequence[TokenizedRow], batch_size: int = 8, progress: bool = False
) -> torch.Tensor:
    """Each row's summed log-probabilities of its labelled (completion) tokens, as the DPO trainer's
    `sequence_logps` sums them, from the engine's prompt logprobs. Each row is scored from its first
    labelled token, so the LM head skips the prompt and a prompt an earlier wave of batch_size rows computed
    comes from the prefix cache. (R,) float64."""
    firsts = [_first_labelled(row) for row in rows]  # labels[0] never counts: nothing predicts the first token
    per_token = token_logprobs(model, [row.input_ids for row in rows], batch_size, progress, first_tokens=firsts)
    sums = [
        math.fsum(logprob for logprob, label in zip(logprobs, row.labels[first:]) if label != IGNORE_INDEX)
        for logprobs, row, first in zip(per_token, rows, firsts)
    ]  # per row: len - first logprobs
    return torch.tensor(sums, dtype=torch.float64)


def _first_labelled(row: TokenizedRow) -> int:
    """The first token after the first that has a label (len(row) when none has)."""
    return next((t for t in range(1, len(row.labels)) if row.labels[t] != IGNORE_INDEX), max(1, len(row.labels)))

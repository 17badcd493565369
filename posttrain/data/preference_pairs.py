"""Preference pairs for the DPO family and the reward model: read, check, tokenize, hold out.

Rows come through the shared data layer (`read_examples`: formats `preference`,
`implicit_preference`, `hh_rlhf`; bad rows reported with file:line and skipped up to
`data.max_bad_row_fraction`). Each pair is tokenized twice, prompt+chosen and prompt+rejected, with
the completion masks of `tokenize_prompt_completion` (the SFT rule: the chat template's assistant
text and end-of-turn token are the completion), or with `encode_for_scoring` for the reward model
(the tokenization `RewardModelScorer` reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.config import DataConfig
from posttrain.data.dataset import read_examples, split_holdout
from posttrain.data.formats import Preference, PromptCompletion
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow, fit_to_length, tokenize_prompt_completion
from posttrain.data.validate import DataError

PAIR_FORMATS = ("preference", "implicit_preference", "hh_rlhf")


@dataclass
class PairRow:
    """One tokenized preference pair. Labels are unshifted (collate shifts them), -100 on the prompt."""

    chosen: TokenizedRow
    rejected: TokenizedRow

    @property
    def prompt_length(self) -> int:
        """Leading tokens of `chosen` that carry no label (the prompt)."""
        return prompt_length(self.chosen)


@dataclass
class PairData:
    train: list[PairRow]
    eval: list[PairRow]
    report: dict[str, Any]


TokenizePair = Callable[[Any, Preference, DataConfig], PairRow]


def tokenize_pair_for_policy(tokenizer: Any, example: Preference, cfg: DataConfig) -> PairRow:
    """Prompt+chosen and prompt+rejected with completion-only labels, each fit to cfg.max_length."""
    rows = []
    for completion in (example.chosen, example.rejected):
        row = tokenize_prompt_completion(tokenizer, PromptCompletion(example.prompt, completion))
        rows.append(fit_to_length(row, cfg.max_length, cfg.overlong))
    return PairRow(*rows)


def _read_pairs(
    cfg: DataConfig, tokenizer: Any, tokenize: TokenizePair, path: str | Path
) -> tuple[list[PairRow], dict[str, Any]]:
    loaded = read_examples(cfg, path)
    if loaded.format not in PAIR_FORMATS:
        raise DataError(
            f"{loaded.source}: rows are {loaded.format!r}, but this trainer needs preference pairs "
            f"(one of {', '.join(PAIR_FORMATS)}: fields prompt/chosen/rejected, or chosen/rejected)"
        )
    pairs = loaded.convert_all(lambda example: tokenize(tokenizer, example, cfg), cfg.max_bad_row_fraction)  # type: ignore[arg-type]
    report = {
        "path": str(path),
        "format": loaded.format,
        "rows_read": loaded.rows_read,
        "pairs_kept": len(pairs),
        "bad_rows": [vars(b) for b in loaded.bad.rows],
    }
    return pairs, report


def load_pairs(
    cfg: DataConfig, tokenizer: Any, seed: int, tokenize: TokenizePair = tokenize_pair_for_policy
) -> PairData:
    """Train and held-out pairs: `cfg.eval_path`, or a seeded `cfg.eval_fraction` of `cfg.path`, or none."""
    pairs, report = _read_pairs(cfg, tokenizer, tokenize, cfg.path)
    train, held = split_holdout(pairs, cfg.eval_fraction, seed)
    if cfg.eval_path:
        held, report["eval"] = _read_pairs(cfg, tokenizer, tokenize, cfg.eval_path)
    report["train_pairs"], report["eval_pairs"] = len(train), len(held)
    return PairData(train, held, report)


def prompt_length(row: TokenizedRow) -> int:
    """Leading tokens of `row` that carry no label (the prompt)."""
    return next((i for i, label in enumerate(row.labels) if label != IGNORE_INDEX), len(row))


def splice_rows(prompt_of: TokenizedRow, completion_of: TokenizedRow, max_length: int) -> TokenizedRow:
    """The prompt of one row followed by the completion of another (KTO's KL estimate rows), cut to
    `max_length`. Assumes the template's prefix property (as the completion masks do)."""
    p, c = prompt_length(prompt_of), prompt_length(completion_of)
    ids = prompt_of.input_ids[:p] + completion_of.input_ids[c:]
    labels = [IGNORE_INDEX] * p + completion_of.labels[c:]
    return TokenizedRow(ids[:max_length], labels[:max_length])


def mismatched_row(prompt_of: PairRow, completion_of: PairRow, max_length: int) -> TokenizedRow:
    """The prompt of one pair followed by the chosen completion of another, cut to `max_length`."""
    return splice_rows(prompt_of.chosen, completion_of.chosen, max_length)

"""Unpaired preference rows for KTO (TRL's KTO dataset: `prompt`, `completion`, `label` bool).

Each row is one sequence, prompt+completion with the SFT completion mask, and a label: True for a
desirable completion, False for an undesirable one. Rows go through the shared data layer (bad rows,
a `label` that is not true/false among them, are reported with file:line and skipped up to
`data.max_bad_row_fraction`).

Batches are fixed: the rows of a split are shuffled once (seeded) and cut into batches of
`batch_size`, and each batch's KL rows pair prompt k with completion k-1 of the same batch (TRL's
rotation, `KTOTrainer._prepare_dataset`). TRL needs sequential sampling for the same reason: the KL
rows must be known in advance so the reference can score them before training.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.config import DataConfig
from posttrain.data.dataset import peek_format, read_examples, split_holdout
from posttrain.data.formats import PromptCompletion, UnpairedPreference
from posttrain.data.preference_pairs import splice_rows
from posttrain.data.tokenize import TokenizedRow, fit_to_length, tokenize_prompt_completion
from posttrain.data.validate import DataError
from posttrain.errors import ConfigError

logger = logging.getLogger("posttrain.trainers")

UNPAIRED_FORMAT = "unpaired_preference"


@dataclass
class UnpairedRow:
    row: TokenizedRow  # prompt + completion; labels on the completion only (unshifted, -100 on the prompt)
    desirable: bool


@dataclass
class KTOSplit:
    """One split's rows, its fixed batches (lists of row indices) and the KL row of every row index."""

    rows: list[UnpairedRow]
    batches: list[list[int]]
    kl: list[TokenizedRow]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class UnpairedData:
    train: KTOSplit
    eval: KTOSplit  # empty without held-out data
    report: dict[str, Any]


def is_unpaired(cfg: DataConfig, loss: str) -> bool:
    """Whether `cfg.path` holds unpaired rows (reads only the rows that decide the format). Raises
    DataError when it does and `loss` needs pairs, so the run stops before it loads a model."""
    if peek_format(cfg) != UNPAIRED_FORMAT:
        return False
    if loss != "kto":
        raise DataError(
            f"{cfg.path}: unpaired rows (prompt/completion/label) train only loss=kto; loss={loss!r} "
            "needs preference pairs (prompt/chosen/rejected, or chosen/rejected)"
        )
    return True


def fixed_batches(n: int, batch_size: int, seed: int) -> list[list[int]]:
    """Row indices 0..n-1 shuffled by `seed` and cut into batches of `batch_size`. A last batch of one row
    joins the one before it: alone, its KL row would be its own (matched) row."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) == 1:
        batches[-2].extend(batches.pop())
    return batches


def kl_rows(rows: list[UnpairedRow], batches: list[list[int]], max_length: int) -> list[TokenizedRow]:
    """KL row of each row index: its prompt + the completion of the previous row of its batch (cyclic)."""
    out: list[TokenizedRow | None] = [None] * len(rows)
    for batch in batches:
        for k, i in enumerate(batch):
            out[i] = splice_rows(rows[i].row, rows[batch[k - 1]].row, max_length)  # k - 1 = -1 wraps to the last
    return out  # type: ignore[return-value]


def make_split(rows: list[UnpairedRow], batch_size: int, seed: int, max_length: int) -> KTOSplit:
    batches = fixed_batches(len(rows), batch_size, seed)
    return KTOSplit(rows, batches, kl_rows(rows, batches, max_length))


def tokenize_unpaired(tokenizer: Any, example: UnpairedPreference, cfg: DataConfig) -> UnpairedRow:
    row = tokenize_prompt_completion(tokenizer, PromptCompletion(example.prompt, example.completion))
    return UnpairedRow(fit_to_length(row, cfg.max_length, cfg.overlong), example.label)


def _read_unpaired(cfg: DataConfig, tokenizer: Any, path: str | Path) -> tuple[list[UnpairedRow], dict[str, Any]]:
    loaded = read_examples(cfg, path)
    if loaded.format != UNPAIRED_FORMAT:
        raise DataError(
            f"{loaded.source}: rows are {loaded.format!r}, but the training file holds unpaired rows "
            f"(prompt/completion/label); give held-out data in the same format"
        )
    rows = loaded.convert_all(
        lambda example: tokenize_unpaired(tokenizer, example, cfg),  # type: ignore[arg-type]
        cfg.max_bad_row_fraction,
    )
    desirable = sum(r.desirable for r in rows)
    report = {
        "path": str(path),
        "format": loaded.format,
        "rows_read": loaded.rows_read,
        "rows_kept": len(rows),
        "desirable": desirable,
        "undesirable": len(rows) - desirable,
        "bad_rows": [vars(b) for b in loaded.bad.rows],
    }
    return rows, report


def check_weights(rows: list[UnpairedRow], desirable_weight: float, undesirable_weight: float) -> None:
    """Warn, as TRL does, when the class weights are far from balancing an uneven desirable/undesirable
    count: KTO paper eq. (8) asks lambda_D n_D / (lambda_U n_U) to lie in [1, 4/3]."""
    n_d = max(sum(r.desirable for r in rows), 1)
    n_u = max(len(rows) - n_d, 1)
    if n_d == n_u:
        return
    d_low, d_high = n_u * undesirable_weight / n_d, n_u * undesirable_weight / n_d * 1.33
    u_low, u_high = n_d * desirable_weight / n_u / 1.33, n_d * desirable_weight / n_u
    if not (d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high):
        logger.warning(
            "kto: %d desirable and %d undesirable training rows; set EITHER desirable_weight in "
            "[%.2f, %.2f] or undesirable_weight in [%.2f, %.2f] (KTO paper, eq. 8)",
            n_d,
            n_u,
            d_low,
            d_high,
            u_low,
            u_high,
        )


def load_unpaired(cfg: DataConfig, tokenizer: Any, seed: int, batch_size: int) -> UnpairedData:
    """Train and held-out splits (`cfg.eval_path`, or a seeded `cfg.eval_fraction` of `cfg.path`, or none)."""
    if batch_size < 2:
        raise ConfigError(
            f"train.batch_size={batch_size}: kto on unpaired rows needs at least 2, since its KL rows "
            "pair each prompt with another completion of the same batch"
        )
    rows, report = _read_unpaired(cfg, tokenizer, cfg.path)
    train, held = split_holdout(rows, cfg.eval_fraction, seed)
    if cfg.eval_path:
        held, report["eval"] = _read_unpaired(cfg, tokenizer, cfg.eval_path)
    for name, split in (("training", train), ("held-out", held)):
        if len(split) == 1:
            raise DataError(f"{cfg.path}: kto needs at least two {name} rows for its KL reference point")
    report["train_rows"], report["eval_rows"] = len(train), len(held)
    return UnpairedData(
        make_split(train, batch_size, seed, cfg.max_length), make_split(held, batch_size, seed, cfg.max_length), report
    )

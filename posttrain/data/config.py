"""The `data` section shared by the offline trainers (SFT, DPO, RM, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.data.formats import FORMATS


@dataclass
class DataConfig:
    path: str = ""  # JSONL / JSONL.gz / JSON / Parquet file, or a datasets save_to_disk directory
    format: str = "auto"  # "auto" or one of posttrain.data.formats.FORMATS
    columns: dict[str, str] = field(default_factory=dict)  # format field -> column in the file, e.g. {prompt: question}
    split: str = "train"  # the split of a saved DatasetDict directory
    max_rows: int | None = None  # read only the first N rows (quick runs)
    as_chat: bool = False  # plain-string prompt/completion -> one user turn + one assistant turn (chat template)
    max_length: int = 1024  # tokens per sequence (and per packed row)
    overlong: Literal["skip", "truncate"] = "skip"  # a longer row: reported and skipped, or cut to max_length
    max_bad_row_fraction: float = 0.05  # abort when more than this fraction of rows is bad
    eval_path: str | None = None  # a separate evaluation file, read like `path`
    eval_fraction: float = 0.0  # or: hold out this fraction of `path` (seeded by train.seed)

    def validate(self) -> None:
        if not self.path:
            raise ValueError("path: a dataset file or directory is required (data.path=...)")
        if self.format != "auto" and self.format not in FORMATS:
            raise ValueError(f"format: unknown format {self.format!r} (choose auto or one of {', '.join(FORMATS)})")
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be positive, got {self.max_rows}")
        if not 0.0 <= self.max_bad_row_fraction <= 1.0:
            raise ValueError(f"max_bad_row_fraction must be in [0, 1], got {self.max_bad_row_fraction}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_path and self.eval_fraction:
            raise ValueError("set eval_path or eval_fraction, not both")

"""SpeculativeConfig: which proposer drafts tokens, and how many per step (`EngineConfig.speculative`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from posttrain.errors import ConfigError

METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 16  # more drafts per step than this would mostly be rejected work


class SpeculativeConfigError(ConfigError, ValueError):
    """A bad SpeculativeConfig value. A ValueError too, so `load_config` adds the file and line to it."""


@dataclass
class SpeculativeConfig:
    """`method`: "ngram" looks up the sequence's last `ngram_max` .. `ngram_min` tokens earlier in its own prompt
    and output and proposes what followed there (prompt lookup); "draft" runs `draft_model` (a smaller model
    with the target's tokenizer, e.g. `posttrain convert --num-layers N`), a name or path for `load_model`.
    Each step proposes up to `num_tokens` tokens per decoding sequence, checked by the target in one forward.
    `adaptive` (default): check only as many of them as the acceptance rate seen so far pays for, none where drafts
    are mostly rejected (draft_length.py); off, every proposal is checked whole."""

    method: Literal["ngram", "draft"] = "ngram"
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    draft_model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.draft_model, Path):
            self.draft_model = str(self.draft_model)
        self.validate()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative.method={self.method!r}: must be one of {', '.join(METHODS)}")
        for name, low, high in (("num_tokens", 1, MAX_NUM_TOKENS), ("ngram_max", 1, 64), ("ngram_min", 1, 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise SpeculativeConfigError(f"speculative.{name}={value!r}: must be an integer in [{low}, {high}]")
        if not isinstance(self.adaptive, bool):
            raise SpeculativeConfigError(f"speculative.adaptive={self.adaptive!r}: must be true or false")
        if self.ngram_min > self.ngram_max:
            raise SpeculativeConfigError(
                f"speculative.ngram_min={self.ngram_min}: must be <= speculative.ngram_max={self.ngram_max}"
            )
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise SpeculativeConfigError(f"speculative.draft_model={self.draft_model!r}: must be a model name or path")
        if self.method == "ngram" and self.draft_model is not None:
            raise SpeculativeConfigError(
                f"speculative.draft_model={self.draft_model!r} is set but speculative.method='ngram'; "
                "use method 'draft' to decode with a draft model"
            )


def as_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a mapping of its fields, or a method name ("ngram") -> SpeculativeConfig | None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        return SpeculativeConfig(method=value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(SpeculativeConfig.__dataclass_fields__))
        if unknown:
            raise SpeculativeConfigError(
                f"speculative: unknown key {unknown[0]!r} (SpeculativeConfig has: "
                f"{', '.join(SpeculativeConfig.__dataclass_fields__)})"
            )
        return SpeculativeConfig(**value)
    raise SpeculativeConfigError(
        f"speculative={value!r}: must be None, a method name, a mapping of SpeculativeConfig fields "
        "or a SpeculativeConfig"
    )

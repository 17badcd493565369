"""`SamplingParams`: one request's generation settings (vLLM's names and defaults), validated on construction.

A bad value raises `InvalidSamplingParams` naming the field and the value. What the settings do to a step's
logits is the sampler's (posttrain/engine/sampler.py, whose docstring gives the order of operations).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.errors import PosttrainError


class InvalidSamplingParams(PosttrainError, ValueError):
    """A `SamplingParams` field with a bad value; the message names the field and the value."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request generation settings, with vLLM's names and defaults.

    `top_k` 0 or -1 turns top-k off. `logprobs`: None / False = no logprob output; True or 0 = the
    sampled token's logprob; k > 0 = also the k most likely tokens. `prompt_logprobs`: None = off;
    0 = each prompt token's logprob under the model's raw distribution (no temperature, no penalties;
    see prompt_logprobs.py); k > 0 = also the k most likely tokens at each prompt position.
    `prompt_logprobs_from=s`: entries only from prompt token s on (None before): the positions before
    need no logits, so they may come from the prefix cache (score completions after a shared prompt).
    `prompt_logprob_ranks=True`: also each prompt token's rank by logit (1 = the most likely), at the cost
    of one more pass over the prompt's logits.
    `max_tokens=0` prefills the prompt and generates nothing (scoring with `prompt_logprobs`).
    `stop` and `stop_token_ids` are normalised to lists (empty when None).
    `logits_processors` (vLLM's): callables `f(output_token_ids, logits) -> logits` over one sequence's raw
    logits row (V,), before penalties and temperature, e.g. a mask of -inf for constrained decoding; the
    logprobs then report the processed distribution (what was sampled from). Such a sequence draws one token a
    step through the sampler: no chained decode steps, no speculative drafts.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool | int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1  # the first prompt token given an entry (earlier ones: None, and no logits)
    prompt_logprob_ranks: bool = False  # also each prompt token's rank by logit (vLLM's `rank`)
    skip_special_tokens: bool = True
    logits_processors: list[Callable[[list[int], torch.Tensor], torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logits_processors is None:
            self.logits_processors = []
        elif isinstance(self.logits_processors, tuple):
            self.logits_processors = list(self.logits_processors)
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise InvalidSamplingParams(f"SamplingParams.{name} must be {requirement}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1 or 0 (off) or an integer >= 1")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "a number > 0")
        check(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "a number in [-2, 2]",
        )
        check(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "a number in [-2, 2]",
        )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a non-empty string or a list of non-empty strings",
        )
        check(
            isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids >= 0",
        )
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "a bool")
        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
            "max_tokens",
            "None or an integer >= 0 (0: prefill only)",
        )
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"<= max_tokens ({self.max_tokens})",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        check(self.seed is None or _is_int(self.seed), "seed", "None or an integer")
        check(
            self.logprobs is None or isinstance(self.logprobs, bool) or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs",
            "None, a bool or an integer >= 0",
        )
        check(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            "None or an integer >= 0",
        )
        check(
            _is_int(self.prompt_logprobs_from) and self.prompt_logprobs_from >= 1,
            "prompt_logprobs_from",
            "an integer >= 1",
        )
        check(
            self.prompt_logprobs is not None or self.prompt_logprobs_from == 1,
            "prompt_logprobs_from",
            "1 unless prompt_logprobs is set",
        )
        check(
            isinstance(self.prompt_logprob_ranks, bool)
            and (self.prompt_logprobs is not None or not self.prompt_logprob_ranks),
            "prompt_logprob_ranks",
            "a bool, and False unless prompt_logprobs is set",
        )
        check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a bool")
        check(
            isinstance(self.logits_processors, list) and all(callable(f) for f in self.logits_processors),
            "logits_processors",
            "a list of callables f(output_token_ids, logits) -> logits",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_top_logprobs(self) -> int:
        """How many most-likely alternatives to report per token (0 when none)."""
        if self.logprobs is None or isinstance(self.logprobs, bool):
            return 0
        return self.logprobs

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

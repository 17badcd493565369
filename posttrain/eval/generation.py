"""How a generation-based evaluation samples: greedy, or n seeded samples per prompt at a temperature.

All prompts go to the engine in one `generate` call (continuous batching over every prompt and sample),
through the RL trainer's own `generate_groups`, so an evaluation here and the trainer's held-out
evaluation decode the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.engine import LLM, EngineConfig, SamplingParams
from posttrain.errors import PosttrainError
from posttrain.eval.prompts import check_prompt_column
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch
from posttrain.rollout.generate import generate_groups


@dataclass(frozen=True)
class Sampling:
    n: int = 1  # samples per prompt
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int = 0  # every prompt's request is seeded with it (sample i of a prompt with seed + i): reproducible
    stop: tuple[str, ...] = ()

    def validate(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise PosttrainError(f"--n must be a positive integer, got {self.n!r}")
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise PosttrainError(f"--temperature must be >= 0, got {self.temperature!r}")
        if self.n > 1 and self.temperature == 0:
            raise PosttrainError(
                f"--n {self.n} with --temperature 0 gives {self.n} identical greedy samples; "
                "set a temperature > 0 to sample"
            )
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise PosttrainError(f"--max-tokens must be a positive integer, got {self.max_tokens!r}")

    def params(self) -> SamplingParams:
        self.validate()
        try:
            return SamplingParams(
                n=self.n,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=self.max_tokens,
                seed=self.seed,
                stop=list(self.stop),
            )
        except ValueError as error:  # the engine's own checks (top_p range, ...)
            raise PosttrainError(str(error)) from None


def make_engine(
    model: str | Path,
    rows: list[dict[str, Any]],
    sampling: Sampling,
    *,
    dtype: str | None = None,
    device: str | None = None,
    max_model_len: int | None = None,
) -> LLM:
    """An engine over `model` sized to this evaluation, as the RL trainer sizes its own: context = the
    longest templated prompt + max_tokens (unless `max_model_len` is given), and every sample of every
    prompt in one wave (up to the engine's default of 512 sequences), so the KV pool is no bigger than
    the evaluation can use."""
    from posttrain.models.hub import load_model

    check_prompt_column(rows)
    module, tokenizer = load_model(model, dtype=dtype, device=device)
    if max_model_len is None:
        longest = max(_prompt_tokens(tokenizer, row[PROMPT_KEY]) for row in rows)
        max_model_len = min(longest + sampling.max_tokens, module.config.max_position_embeddings)
    seqs = min(EngineConfig().max_num_seqs, len(rows) * sampling.n)
    config = EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(EngineConfig().max_num_batched_tokens, seqs),
    )
    return LLM(model=module, tokenizer=tokenizer, config=config)


def _prompt_tokens(tokenizer: Any, prompt: Any) -> int:
    """Token count of a prompt as the engine encodes it: text as is, chat messages through the template."""
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=True))
    if prompt and all(isinstance(m, dict) for m in prompt):
        return len(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True))
    return len(prompt)  # token ids


def sample(llm: LLM, rows: list[dict[str, Any]], sampling: Sampling, progress: bool = False) -> RolloutBatch:
    """`sampling.n` completions of every row's prompt: texts and token ids, grouped row by row
    (sample b belongs to row b // n)."""
    if not rows:
        raise PosttrainError("no prompts to evaluate")
    check_prompt_column(rows)
    return generate_groups(llm, rows, sampling.params(), use_tqdm=progress)

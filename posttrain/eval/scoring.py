"""Token log-probabilities of whole sequences, through the engine: each sequence is a prefill-only request
(`max_tokens=0`) asking for its prompt logprobs, so the engine batches them (continuous batching, no
padding, chunked prefill) and makes the LM-head logits in bounded chunks. Scored from a later token
(`first_tokens`: a completion after its prompt), the positions before it need no logits: the LM head skips
them, and a prompt that an earlier wave of sequences computed comes from the prefix cache.

The numbers are the model's raw distribution, log_softmax(logits at t - 1)[token t], what a dense forward
pass computes (tested to 1e-4; on the default model in fp32 each is within 3e-5 of a float64 pass): the engine
computes in the weights' dtype here, fp32 weights in fp32 whatever EngineConfig.compute_dtype's auto would pick.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.engine import LLM, EngineConfig, SamplingParams
from posttrain.errors import PosttrainError

BLOCK_SIZE = 16


def scoring_config(lengths: Sequence[int], batch_size: int, prefix_caching: bool = False) -> EngineConfig:
    """An engine sized for these sequences: `batch_size` of the longest in flight at once, each prefilled in
    one step, and a KV pool that holds them all (so nothing is ever preempted). Prefix caching only when
    asked for (sequences scored from a later token): the pool then holds a second wave's worth of blocks, so
    a finished wave's cached prompts are still there when the next wave is admitted."""
    longest = max(lengths)
    return EngineConfig(
        block_size=BLOCK_SIZE,
        num_kv_blocks=(2 if prefix_caching else 1) * batch_size * -(-longest // BLOCK_SIZE),
        max_num_seqs=batch_size,
        max_num_batched_tokens=batch_size * longest,
        max_model_len=longest,
        enable_prefix_caching=prefix_caching,
        watermark=0.0,  # prefill-only sequences never grow: no room to keep for them
    )


@torch.no_grad()
def token_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    batch_size: int = 8,
    progress: bool = False,
    first_tokens: Sequence[int] | None = None,
) -> list[list[float]]:
    """For each sequence of token ids, log p(token t | tokens < t) for t = first .. len - 1 (len - first
    floats; none when first >= len), in the order given. first: first_tokens[i] (>= 1), else 1.
    `batch_size`: sequences prefilled together, in the order given (a wave after a wave)."""
    if batch_size < 1:
        raise PosttrainError(f"batch_size must be >= 1, got {batch_size}")
    firsts = list(first_tokens) if first_tokens is not None else [1] * len(sequences)
    if len(firsts) != len(sequences) or any(f < 1 for f in firsts):
        raise PosttrainError(f"first_tokens: one integer >= 1 per sequence ({len(sequences)}), got {firsts[:8]}")
    scored = [i for i, ids in enumerate(sequences) if len(ids) > firsts[i]]
    result: list[list[float]] = [[] for _ in sequences]
    if not scored:
        return result
    prompts = [list(sequences[i]) for i in scored]
    config = scoring_config([len(p) for p in prompts], batch_size, prefix_caching=first_tokens is not None)
    if next(model.parameters()).dtype == torch.float32:  # the weights' own arithmetic, never bf16 copies of them
        config.compute_dtype = "float32"
    llm = LLM(model, config=config)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_from=firsts[i]) for i in scored]
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    for i, out in zip(scored, outputs):
        result[i] = out.prompt_logprobs[firsts[i] :]
    return result

"""Chained decode steps (EngineConfig.decode_steps): a decode step of a few sequences runs up to k steps in one native
call, each step's drawn tokens feeding the next (decode_step.c's decode_chained_steps), and the engine appends the k
tokens of each sequence afterwards.

Why: at batch 1 the C parts of a token (the decoder and the LM head) take ~8 ms for SmolLM2-135M in q8_0 on a 2-core
Zen 5, and the Python around them ~2 ms more: scheduling, the step's inputs, the native step's table check, the
sampler and the bookkeeping of the appended token. Chained, that Python runs once per k tokens. vLLM's multi-step
scheduling does the same on GPUs.

When: the step has at most MAX_ROWS sequences (8: batch-1 and small-batch decode; in a wider step the per-step Python
is a sliver of its time), every one decodes one token (no prompt chunk, no drafts, no fork pending), no request waits
to be admitted (it would wait k tokens longer), the native decode step takes the batch with its LM head
(`NativeDecode.can_run_chain`), and the sequences' draws are all of one of the two kinds the chain makes:
- greedy: the logits' argmax (no penalty, min_tokens reached: `Sequence.draws_argmax`), any logprobs settings;
- plain sampling: temperature > 0 from the full softmax (no top-k / top-p / min-p, no penalty, min_tokens reached,
  no top logprobs asked), the sampler's one-pass draw (sampler.c) with the uniforms the one-step sampler would use:
  drawn ahead from the same generators, which are then left as if only the steps that ran had drawn.
The chain is at most k steps, never past a sequence's max_tokens or max_model_len nor past the free blocks, and it
stops after the step where some sequence drew one of the tokens that can end a sequence of the batch
(`halting_tokens`).

What changes for a caller: nothing in the tokens, logprobs and texts (each step is bit for bit a plain step; stop
strings and max_tokens apply token by token as the tokens are appended, and what follows a stop is dropped); a
streaming request sees up to k tokens per engine step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.engine.scheduler import ScheduledBatch
from posttrain.engine.sequence import Sequence
from posttrain.engine.small_rows_linear import MAX_ROWS


def draws_plain_sample(seq: Sequence) -> bool:
    """Whether seq's next tokens are drawn from the full softmax of its logits over its temperature, with nothing
    else reported than each token's logprob (what the chain's sampled rows compute)."""
    params = seq.params
    return (
        not params.is_greedy
        and not params.has_filters
        and not params.has_penalties
        and params.num_top_logprobs == 0
        and not params.logits_processors
        and seq.num_output_tokens >= params.min_tokens
    )


def chain_length(batch: ScheduledBatch, most: int, max_model_len: int) -> int:
    """How many steps the batch may chain: 1 where it may not (module docstring), else at most `most`, no sequence
    past its max_tokens or max_model_len (the blocks are checked by the caller)."""
    if most <= 1 or len(batch.seqs) > MAX_ROWS:  # wider steps: the per-step Python is a sliver of their time
        return 1
    greedy = [seq.draws_argmax for seq in batch.seqs]
    if not (all(greedy) or (not any(greedy) and all(draws_plain_sample(seq) for seq in batch.seqs))):
        return 1  # mixed draws: the one-step sampler takes another path for such a batch (torch's, not sampler.c's)
    steps = most
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        decoding = num_new == 1 and seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
        if not decoding or seq.draft_token_ids or seq.num_forks:
            return 1
        steps = min(steps, seq.tokens_left, max_model_len - seq.num_tokens)
    return max(steps, 1)


def halting_tokens(seqs: list[Sequence], eos_token_ids: set[int]) -> list[int]:
    """The tokens after which the chain stops: any that ends one of the sequences (an EOS where it is not ignored,
    its stop_token_ids)."""
    halt: set[int] = set()
    for seq in seqs:
        if not seq.params.ignore_eos:
            halt |= eos_token_ids
        halt.update(seq.params.stop_token_ids or ())
    return sorted(halt)


@dataclass
class ChainDraws:
    """How the chain's rows draw: temperatures (S,), 0 for the argmax; uniforms (steps, S) fp64 for the sampled ones;
    `rewind(j)` once the chain ran j steps (the generators left as if only those had drawn)."""

    temperatures: list[float]
    uniforms: torch.Tensor
    rewind: Callable[[int], None]

    @property
    def greedy(self) -> bool:
        return not any(self.temperatures)


def chain_draws(seqs: list[Sequence], steps: int) -> ChainDraws:
    """The draws of a batch `chain_length` let chain: all greedy, or all plain sampling."""
    if seqs[0].params.is_greedy:  # all of them (chain_length)
        return ChainDraws([0.0] * len(seqs), torch.zeros(steps, len(seqs), dtype=torch.float64), lambda ran: None)
    uniforms, rewind = uniforms_ahead(seqs, steps)
    return ChainDraws([seq.params.temperature for seq in seqs], uniforms, rewind)


def uniforms_ahead(seqs: list[Sequence], steps: int) -> tuple[torch.Tensor, Callable[[int], None]]:
    """The uniforms the one-step sampler (sampler.py `_uniforms`) would draw for these sequences over `steps` steps in
    a row, drawn now: (steps, S) fp64, step after step. A seeded sequence's come from its generator, one a step; the
    others' from torch's default generator, one per such sequence a step, in batch order. Returns them and `rewind(j)`,
    which leaves every generator as if only the first j steps had drawn (a chain that stopped early)."""
    uniforms = torch.empty(steps, len(seqs), dtype=torch.float64)
    seeded = [i for i, seq in enumerate(seqs) if seq.generator is not None]
    unseeded = [i for i, seq in enumerate(seqs) if seq.generator is None]
    states = {i: seqs[i].generator.get_state() for i in seeded}
    default_state = torch.get_rng_state() if unseeded else None
    for i in seeded:
        uniforms[:, i] = torch.rand(steps, dtype=torch.float64, generator=seqs[i].generator)
    if unseeded:  # what `steps` draws of len(unseeded) each take from the default generator, in order
        uniforms[:, unseeded] = torch.rand(steps, len(unseeded), dtype=torch.float64)

    def rewind(ran: int) -> None:
        if ran == steps:
            return
        for i in seeded:
            seqs[i].generator.set_state(states[i])
            torch.rand(ran, dtype=torch.float64, generator=seqs[i].generator)
        if unseeded:
            torch.set_rng_state(default_state)
            torch.rand(ran, len(unseeded), dtype=torch.float64)

    return uniforms, rewind

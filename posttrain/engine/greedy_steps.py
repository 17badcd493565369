"""Chained greedy decode steps (EngineConfig.decode_steps): a decode step of greedy sequences runs up to k steps in
one native call, each step's argmax feeding the next (decode_step.c's decode_greedy_steps), and the engine appends
the k tokens of each sequence afterwards.

Why: at batch 1 the C parts of a token (the decoder and the LM head) take ~8 ms for SmolLM2-135M in q8_0 on a 2-core
Zen 5, and the Python around them ~2 ms more: scheduling, the step's inputs, the native step's table check, the
sampler and the bookkeeping of the appended token. Chained, that Python runs once per k tokens. vLLM's multi-step
scheduling does the same on GPUs.

When: every sequence of the step decodes one token (no prompt chunk, no drafts, no fork pending), draws by argmax
(greedy, no penalty, min_tokens reached: `Sequence.draws_argmax`), no request waits to be admitted (it would wait k
tokens longer), and the native decode step takes the batch with its LM head (`NativeDecode.can_run_steps`). The
chain is at most k steps, never past a sequence's max_tokens or max_model_len nor past the free blocks, and it stops
after the step where some sequence drew one of the tokens that can end a sequence of the batch (`halting_tokens`).

What changes for a caller: nothing in the tokens, logprobs and texts (each step is bit for bit a plain step; stop
strings and max_tokens apply token by token as the tokens are appended, and what follows a stop is dropped); a
streaming request sees up to k tokens per engine step.
"""

from __future__ import annotations

from posttrain.engine.scheduler import ScheduledBatch
from posttrain.engine.sequence import Sequence


def chain_length(batch: ScheduledBatch, most: int, max_model_len: int) -> int:
    """How many greedy steps the batch may chain: 1 where it may not (module docstring), else at most `most`, no
    sequence past its max_tokens or max_model_len (the blocks are checked by the caller)."""
    if most <= 1:
        return 1
    steps = most
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        decoding = num_new == 1 and seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
        if not decoding or seq.draft_token_ids or seq.num_forks or not seq.draws_argmax:
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

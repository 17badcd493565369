"""Sequences: the engine's unit of bookkeeping. Plain Python over token ids; no tensors but a generator."""

from __future__ import annotations

import enum
import itertools
from typing import Any

import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: holds no blocks, recomputes from token 0 (less cache hits)
    RUNNING = "running"  # holds blocks; prefilling in chunks or decoding one token a step
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One sample of one request: prompt + generated tokens, and where their K/V lives.

    A request with n samples starts as ONE sequence with `num_forks = n - 1`: its prompt is prefilled once,
    then at its first sampled token it forks into n sequences that share the prompt blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        generator: torch.Generator | None,
        index: int = 0,
        num_forks: int = 0,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # sample index within the request, 0..n-1
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0  # leading tokens whose K/V is in the cache (computed or found by hash)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # content hash of each full block, a chain over the whole prefix
        self.status = SequenceStatus.WAITING
        self.params = params
        self.generator = generator
        self.num_forks = num_forks
        self.output_logprobs: list[float] = []
        # Per generated token: the engine's policy version when it was drawn (weights may change between
        # engine steps while a sequence runs: asynchronous RL's in-flight updates).
        self.output_policy_versions: list[int] = []
        self.output_top_logprobs: list[Any] = []
        # Set by the engine on a request's first sequence when it asks for prompt logprobs (a PromptLogprobs,
        # filled as the prompt is prefilled); forks never get one: the parent computed them before forking.
        self.prompt_logprobs: Any = None
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        self.num_cache_hit_tokens = 0  # tokens found in the prefix cache at the last admission
        self.policy_version: int | None = None  # version of the weights that sampled its first token
        # Tokens proposed to follow token_ids, checked by this step's forward (speculative decoding,
        # posttrain/engine/speculative); empty outside a speculative step. Never part of token_ids.
        self.draft_token_ids: list[int] = []
        # True while its cache holds K/V computed under weights older than the engine's current ones (it kept
        # running across an in-flight weight update: `weights_updated(keep_running_kv=True)`). Such blocks are
        # never published to the prefix cache; a preempted sequence recomputes everything and is fresh again.
        self.stale_kv = False

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"tokens={self.num_tokens}, cached={self.num_cached_tokens}, blocks={len(self.block_table)}, "
            f"{self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is still to be computed (1 while decoding, the rest of the prompt while prefilling)."""
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens whose K/V may be taken from the prefix cache: all but the last (its logits give the
        next token), and, while prompt logprobs are still being collected, only the positions that already
        have theirs (a cached position skips the forward pass that would make its logits)."""
        pending = self.prompt_logprobs is not None and not self.prompt_logprobs.done
        return self.prompt_logprobs.num_known if pending else self.num_tokens - 1

    @property
    def draws_argmax(self) -> bool:
        """Whether its next tokens are its logits' argmax: greedy, with no penalty and no min_tokens mask left (its
        output is already that long, so every later token's is too). Speculative checks and chained decode steps
        pick such a sequence's tokens straight from the logits."""
        params = self.params
        return (
            params.is_greedy
            and not params.has_penalties
            and not params.logits_processors
            and self.num_output_tokens >= params.min_tokens
        )

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate under max_tokens (a large number when it has none)."""
        limit = self.params.max_tokens
        return 1 << 30 if limit is None else limit - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling with the same tokens so far; the caller shares the blocks (BlockManager.fork)."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, generator, index=index)
        child.token_ids = list(self.token_ids)
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.policy_version = self.policy_version
        child.output_policy_versions = list(self.output_policy_versions)
        child.stale_kv = self.stale_kv
        return child

"""The speculative decoder: drafts for a scheduled step's decoding sequences, and the acceptance test on the
target's logits at the drafted positions.

A step with drafts: the scheduler schedules as always (one token per decoding sequence); `add_drafts` asks the
proposer for up to `num_tokens` tokens per decoding sequence and widens its share of the step to 1 + k tokens
(the last token and the drafts, a short prefill-like chunk over the paged KV; the blocks they need are allocated
here, never by preempting another sequence). The runner returns the logits of all 1 + k positions; `verify` runs
the acceptance rule (acceptance.py) under each request's sampling settings (for a step of plain greedy requests,
straight from the logits' argmax: no distributions formed) and returns the tokens to append: the
accepted drafts, then one token from the target (the correction at the first rejection, or one past the last
draft), each with the target's logprob. The engine appends them one at a time (stops, max_tokens and stop
strings apply to each as in plain decoding) and gives back the blocks that held only rejected positions; K/V
written at a rejected position is overwritten when that position is computed again.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.config import EngineConfig
from posttrain.engine.sampler import SamplingRow, SamplingWorkspace, draw_probabilities, reported_logprobs
from posttrain.engine.scheduler import ScheduledBatch
from posttrain.engine.sequence import Sequence
from posttrain.engine.speculative.acceptance import verify_drafts, verify_greedy_drafts
from posttrain.engine.speculative.config import SpeculativeConfig
from posttrain.engine.speculative.draft_length import DraftLength
from posttrain.engine.speculative.draft_model import DraftModelProposer
from posttrain.engine.speculative.ngram import NgramProposer
from posttrain.engine.speculative.proposal import Proposal, Proposer, sequence_uniforms
from posttrain.errors import PosttrainError

# One token the target appends: (token id, its logprob, its top logprobs or None).
AppendedToken = tuple[int, float, Any]


class SpeculativeDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        engine_config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: set[int],
        proposer: Proposer,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        self.reserve_blocks = engine_config.reserve_blocks(block_manager.num_blocks)
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.workspace = SamplingWorkspace()
        self.pending: dict[int, Proposal] = {}  # seq_id -> the proposal its drafts came from, this step
        self.num_draft_tokens = 0  # drafts checked by the target
        self.num_accepted_tokens = 0
        self.num_verifications = 0  # (sequence, step) pairs that checked drafts
        self.num_skipped_tokens = 0  # n-gram drafts proposed but not checked: they would not have paid (adaptive)
        self.length = DraftLength() if config.adaptive else None
        self.step_shape: tuple[int, int] | None = None  # this step's (decoding sequences, draft rows), if pure decode
        self.decode_steps = 1  # the decode steps this engine step chained (`chained`)

    # ---- drafting ----------------------------------------------------------------------------------------

    def add_drafts(self, batch: ScheduledBatch) -> None:
        """Give the batch's decoding sequences drafts (seq.draft_token_ids) and widen their share of the step to
        the last token plus the drafts, within the token budget, max_model_len, max_tokens and the free blocks,
        and, with `adaptive`, as many of each proposal's drafts as pay for their rows (draft_length.py)."""
        self.step_shape, self.decode_steps = None, 1
        budget = self.max_num_batched_tokens - batch.num_batched_tokens
        chosen: list[int] = []
        caps: list[int] = []
        decoding = 0
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if num_new != 1 or seq.num_output_tokens == 0 or seq.num_uncomputed_tokens != 1:
                continue  # prefilling: its next token comes from the prompt's logits
            if seq.params.logits_processors:
                continue  # its logits are processed before each draw: drafts checked on raw logits would skip that
            decoding += 1
            if budget <= 0:
                continue
            # a step appends at most drafts + 1 tokens: never past max_model_len or max_tokens
            cap = min(self.config.num_tokens, budget, self.max_model_len - seq.num_tokens - 1, seq.tokens_left - 1)
            if cap >= 1:
                chosen.append(i)
                caps.append(cap)
                budget -= cap
        if decoding == len(batch.seqs):  # a pure decode step: its time goes into the cost of a draft row
            self.step_shape = (decoding, 0)
        if not chosen:
            return
        length, num_seqs = self.length, len(batch.seqs)
        if length is not None:
            length.drafting_step()
            fixed_kind = getattr(self.proposer, "kind", None)
            if fixed_kind is not None:  # the draft model: decide before it runs, so unchecked drafts cost nothing
                caps = length.choose([(fixed_kind, cap) for cap in caps], num_seqs)
                chosen, caps = [i for i, c in zip(chosen, caps) if c], [c for c in caps if c]
                if not chosen:
                    return
        proposals = self.proposer.propose([batch.seqs[i] for i in chosen], caps)
        counts = [len(p.token_ids) for p in proposals]
        if length is not None:
            proposed = sum(counts)
            counts = length.choose([(p.kind, n) for p, n in zip(proposals, counts)], num_seqs)
            self.num_skipped_tokens += proposed - sum(counts)
        bm = self.block_manager
        draft_rows = 0
        for i, proposal, count in zip(chosen, proposals, counts):
            seq, num_new = batch.seqs[i], 1 + count
            if num_new == 1 or not bm.can_allocate(seq, num_new, self.reserve_blocks):
                continue
            bm.allocate(seq, num_new)  # the last token's block is in place: only the drafts' new blocks
            seq.draft_token_ids = list(proposal.token_ids[:count])
            batch.num_new_tokens[i] = num_new
            self.pending[seq.seq_id] = proposal
            draft_rows += count
        if self.step_shape is not None:
            self.step_shape = (decoding, draft_rows)

    def chained(self, steps: int) -> None:
        """This engine step ran `steps` chained decode steps (posttrain/engine/chained_steps.py): its time counts per
        decode step, what a draft row is weighed against."""
        self.decode_steps = steps

    def step_took(self, seconds: float) -> None:
        """The engine's step (drafting, the forward, the check) took `seconds`: a pure decode step's time (a chain's
        share per decode step) feeds the cost of a draft row."""
        if self.length is not None and self.step_shape is not None:
            self.length.step_took(*self.step_shape, seconds / self.decode_steps)
        self.step_shape, self.decode_steps = None, 1

    def discard(self, batch: ScheduledBatch) -> None:
        """The step failed: forget its drafts (the blocks they took stay with their sequences, to be used next)."""
        for seq in batch.seqs:
            seq.draft_token_ids = []
        self.pending.clear()
        self.step_shape = None

    # ---- checking --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, checking: list[tuple[Sequence, int]]) -> list[list[AppendedToken]]:
        """checking: (sequence, its first row of `logits`) for each sequence with drafts, whose 1 + k rows are the
        target's logits at its last token and at each draft. Returns, per sequence, the tokens to append; clears
        the drafts."""
        seqs = [seq for seq, _ in checking]
        counts = [len(seq.draft_token_ids) for seq in seqs]
        index = [row for (_, first), count in zip(checking, counts) for row in range(first, first + count + 1)]
        if index != list(range(logits.shape[0])):
            logits = logits[torch.tensor(index, device=logits.device)]
        proposals = [self.pending.pop(seq.seq_id) for seq in seqs]
        if all(seq.draws_argmax for seq in seqs):
            scaled = logits.float()
            num_accepted, next_token = verify_greedy_drafts(scaled, [seq.draft_token_ids for seq in seqs])
        else:
            scaled, num_accepted, next_token = self._sampled_check(logits, seqs, counts, proposals)

        kept_rows: list[int] = []  # the rows whose distributions gave the appended tokens
        kept_tokens: list[int] = []
        first = 0
        for seq, count, accepted, last, proposal in zip(seqs, counts, num_accepted, next_token, proposals):
            if self.length is not None:
                self.length.checked(proposal.kind, count, accepted)
            kept_rows.extend(range(first, first + accepted + 1))
            kept_tokens.extend([*seq.draft_token_ids[:accepted], last])
            first += count + 1
        # what reported_logprobs reads of a row is its settings (top logprobs): one row per kept token, its sequence's
        owners = [seq for seq, accepted in zip(seqs, num_accepted) for _ in range(accepted + 1)]
        kept = [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids) for seq in owners]
        for seq in seqs:
            seq.draft_token_ids = []
        logprobs, top = reported_logprobs(
            scaled[torch.tensor(kept_rows, device=scaled.device)], kept, torch.tensor(kept_tokens, device=scaled.device)
        )
        logprobs = logprobs.tolist()
        self.num_verifications += len(seqs)
        self.num_draft_tokens += sum(counts)
        self.num_accepted_tokens += sum(num_accepted)
        appended: list[list[AppendedToken]] = []
        start = 0
        for accepted in num_accepted:
            end = start + accepted + 1
            appended.append(
                [(kept_tokens[j], logprobs[j], top[j] if top is not None else None) for j in range(start, end)]
            )
            start = end
        return appended

    def _sampled_check(
        self, logits: torch.Tensor, seqs: list[Sequence], counts: list[int], proposals: list[Proposal]
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """The acceptance rule under each request's sampling settings. logits (R, V): each sequence's 1 + k rows in
        turn. Returns (the scaled logits (R, V) the reported logprobs come from, num_accepted and next_token per
        sequence)."""
        rows: list[SamplingRow] = []  # one per position: the history before it includes the drafts before it
        for seq in seqs:
            drafts, prompt, output = seq.draft_token_ids, seq.prompt_token_ids, seq.output_token_ids
            rows.extend(
                SamplingRow(seq.params, prompt, output + drafts[:j], seq.generator, self.eos_token_ids)
                for j in range(len(drafts) + 1)
            )
        scaled, probs = draw_probabilities(logits, rows, self.workspace)  # (R, V) each
        num_accepted, next_token = verify_drafts(
            *self._padded(probs, seqs, counts, proposals), sequence_uniforms(seqs, max(counts) + 1, probs.device)
        )
        return scaled, num_accepted.tolist(), next_token.tolist()

    @staticmethod
    def _padded(
        probs: torch.Tensor, seqs: list[Sequence], counts: list[int], proposals: list[Proposal]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """verify_drafts' inputs: target (B, K+1, V), drafts (B, K), counts (B,), draft distributions (B, K, V) or
        None, from the (R, V) rows of `probs` (each sequence's 1 + k rows in turn)."""
        batch, width, vocab = len(seqs), max(counts), probs.shape[-1]
        device = probs.device
        drafts = torch.tensor([seq.draft_token_ids + [0] * (width - len(seq.draft_token_ids)) for seq in seqs])
        drafts = drafts.to(device)  # (B, K)
        if batch == 1:
            target = probs[None]  # (1, K+1, V)
        else:
            target = probs.new_zeros(batch, width + 1, vocab)
            first = 0
            for b, count in enumerate(counts):
                target[b, : count + 1] = probs[first : first + count + 1]
                first += count + 1
        draft_probs = None
        if any(p.probs is not None for p in proposals):
            draft_probs = probs.new_zeros(batch, width, vocab)  # (B, K, V)
            for b, (count, proposal) in enumerate(zip(counts, proposals)):
                if proposal.probs is not None:
                    draft_probs[b, :count] = proposal.probs[:count]
                else:  # point masses at the drafts
                    draft_probs[b, torch.arange(count, device=device), drafts[b, :count]] = 1.0
        return target, drafts, torch.tensor(counts, device=device), draft_probs

    # ---- memory and numbers --------------------------------------------------------------------------------

    def release(self) -> None:
        """The engine is idle: forget per-sequence state (n-gram indexes, the draft model's K/V)."""
        self.pending.clear()
        self.proposer.release()

    def free_kv_cache(self) -> None:
        self.release()
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.free_kv_cache()

    def allocate_kv_cache(self) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.allocate_kv_cache()

    def stats(self) -> dict[str, float]:
        """acceptance rate: accepted / drafted tokens; mean accepted length: drafts accepted per checking step (each
        such step appends that many tokens plus one)."""
        return {
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verifications": self.num_verifications,
            "spec_skipped_draft_tokens": self.num_skipped_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_mean_accepted_length": (
                self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0
            ),
            **self.proposer.stats(),
        }


def build_speculative_decoder(
    engine_config: EngineConfig,
    target_model: torch.nn.Module,
    block_manager: BlockManager,
    max_model_len: int,
    eos_token_ids: set[int],
    draft_model: torch.nn.Module | None = None,
) -> SpeculativeDecoder | None:
    """The decoder `engine_config.speculative` asks for, or None when it is off. A draft model is `draft_model` when
    given, else loaded from `speculative.draft_model` (a name or path) in the target's dtype, on its device."""
    config = engine_config.speculative
    if config is None:
        if draft_model is not None:
            raise PosttrainError("draft_model= needs speculative decoding on: speculative={'method': 'draft'}")
        return None
    if config.method == "ngram":
        if draft_model is not None:
            raise PosttrainError("draft_model= is given but speculative.method='ngram'; use method 'draft'")
        proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        if draft_model is None:
            draft_model = load_draft_model(config, target_model)
        proposer = DraftModelProposer(
            draft_model, target_model, engine_config, block_manager.num_blocks, max_model_len, eos_token_ids
        )
    return SpeculativeDecoder(config, engine_config, block_manager, max_model_len, eos_token_ids, proposer)


def load_draft_model(config: SpeculativeConfig, target_model: torch.nn.Module) -> torch.nn.Module:
    """speculative.draft_model loaded in the target's dtype and on its device."""
    if config.draft_model is None:
        raise PosttrainError("speculative.method='draft' needs speculative.draft_model (a model name or path)")
    from posttrain.models.hub import load_model

    param = next(target_model.parameters())
    model, _ = load_model(config.draft_model, dtype=param.dtype, device=param.device)
    return model

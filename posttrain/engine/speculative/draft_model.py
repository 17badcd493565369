"""Drafts from a smaller model with the target's tokenizer (e.g. `posttrain convert --num-layers N`).

The draft model has its own paged KV pool and model runner. Each target sequence that drafts has a shadow
sequence here holding the same tokens, then its own drafts. At the next step the shadow keeps the tokens the
target accepted and rolls its K/V back to them (the positions after are recomputed, their blocks given back),
then runs one forward per draft: the first over every token it has not seen (the whole prompt the first time,
else the one or two tokens the target added), the others over the draft it just drew.

A draft is drawn from the draft model's own distribution under the request's sampling settings (temperature,
penalties, top-k / top-p / min-p; `sampler.draw_probabilities`), which the acceptance test needs (q); greedy
requests draft the draft model's argmax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posttrain.engine.block_manager import BlockManager
from posttrain.engine.config import EngineConfig
from posttrain.engine.runner import ModelRunner
from posttrain.engine.sampler import SamplingRow, SamplingWorkspace, draw_probabilities, sample_from_weights
from posttrain.engine.scheduler import ScheduledBatch
from posttrain.engine.sequence import Sequence, SequenceStatus
from posttrain.engine.speculative.proposal import NO_PROPOSAL, Proposal, sequence_uniforms
from posttrain.errors import PosttrainError


@dataclass
class _Shadow:
    target: Sequence  # the engine's sequence it drafts for
    seq: Sequence  # the draft model's copy: the target's tokens, then this step's drafts
    num_confirmed: int  # leading tokens of seq known to be the target's


class DraftModelProposer:
    kind = 0  # its proposals share one acceptance rate, known before it drafts (draft_length.py)

    def __init__(
        self,
        draft_model: torch.nn.Module,
        target_model: torch.nn.Module,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: set[int],
    ) -> None:
        check_draft_model(draft_model, target_model, max_model_len)
        self.model = draft_model
        self.eos_token_ids = eos_token_ids
        # Its own pool of as many blocks as the target's (each holds fewer layers); no prefix cache, no graphs.
        draft_config = dataclasses.replace(
            config, speculative=None, enable_prefix_caching=False, cuda_graphs=False, num_kv_blocks=num_blocks
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(draft_model, draft_config, num_blocks)
        self.workspace = SamplingWorkspace()
        self.shadows: dict[int, _Shadow] = {}  # target seq_id -> shadow
        self.num_forward_passes = 0
        self.num_draft_model_tokens = 0  # tokens through the draft model (its prefills included)

    # ---- shadows ------------------------------------------------------------------------------------

    def _shadow(self, target: Sequence) -> _Shadow:
        """target's shadow, holding target's tokens, its K/V kept only over the tokens the target confirmed."""
        shadow = self.shadows.get(target.seq_id)
        if shadow is None:
            seq = Sequence(target.request_id, target.prompt_token_ids, target.params, None)
            seq.token_ids = list(target.token_ids)
            shadow = self.shadows[target.seq_id] = _Shadow(target, seq, target.num_tokens)
            return shadow
        seq, tokens = shadow.seq, target.token_ids
        agreed = shadow.num_confirmed  # then the drafts the target accepted
        limit = min(seq.num_tokens, len(tokens))
        while agreed < limit and seq.token_ids[agreed] == tokens[agreed]:
            agreed += 1
        del seq.token_ids[agreed:]
        seq.token_ids.extend(tokens[agreed:])
        shadow.num_confirmed = len(tokens)
        seq.num_cached_tokens = min(seq.num_cached_tokens, agreed)  # K/V past the agreement is recomputed
        self.block_manager.truncate(seq, seq.num_cached_tokens)
        return shadow

    def _drop(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id)
        self.block_manager.free(shadow.seq)

    def _drop_stale(self) -> None:
        """Forget the shadows of sequences that finished or were preempted (their blocks are better used now)."""
        stale = [i for i, s in self.shadows.items() if s.target.status is not SequenceStatus.RUNNING]
        for seq_id in stale:
            self._drop(seq_id)

    # ---- proposing ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Proposal]:
        self._drop_stale()
        shadows = [self._shadow(seq) for seq in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            batch = ScheduledBatch()
            running = []
            for i in active:
                seq = shadows[i].seq
                num_new = seq.num_uncomputed_tokens
                if not self.block_manager.can_allocate(seq, num_new):
                    continue  # the draft pool is full: this sequence drafts no further this step
                self.block_manager.allocate(seq, num_new)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                running.append(i)
            if not running:
                break
            logits = self.runner.execute(batch).logits  # (R, V), one row per shadow
            self.num_forward_passes += 1
            self.num_draft_model_tokens += batch.num_batched_tokens
            tokens, token_probs = self._draw(logits, [seqs[i] for i in running], [drafts[i] for i in running])
            for row, i in enumerate(running):
                seq = shadows[i].seq
                seq.num_cached_tokens = seq.num_tokens
                seq.token_ids.append(tokens[row])
                drafts[i].append(tokens[row])
                if token_probs is not None and not seqs[i].params.is_greedy:
                    probs[i].append(token_probs[row])
            active = [i for i in running if len(drafts[i]) < max_drafts[i]]
        return [Proposal(d, torch.stack(p) if p else None) if d else NO_PROPOSAL for d, p in zip(drafts, probs)]

    def _draw(
        self, logits: torch.Tensor, targets: list[Sequence], drafts: list[list[int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """One draft per row, under each target sequence's sampling settings with its drafts so far as output.
        Returns the tokens and, unless every row is greedy, the (R, V) distributions they were drawn from."""
        rows = [
            SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids + d, seq.generator, self.eos_token_ids)
            for seq, d in zip(targets, drafts)
        ]
        _, probs = draw_probabilities(logits, rows, self.workspace)  # (R, V)
        if all(seq.params.is_greedy for seq in targets):
            return probs.argmax(dim=-1).tolist(), None  # greedy rows are point masses
        uniforms = sequence_uniforms(targets, 1, probs.device)[:, 0]  # (R,), 0 for greedy rows
        return sample_from_weights(probs, uniforms).tolist(), probs

    # ---- memory -----------------------------------------------------------------------------------------

    def release(self) -> None:
        for seq_id in list(self.shadows):
            self._drop(seq_id)
        self.runner.release_step_buffers()

    def free_kv_cache(self) -> None:
        self.release()
        self.runner.free_kv_cache()

    def allocate_kv_cache(self) -> None:
        self.runner.allocate_kv_cache()

    def stats(self) -> dict[str, float]:
        return {
            "spec_draft_forward_passes": self.num_forward_passes,
            "spec_draft_model_tokens": self.num_draft_model_tokens,
        }


def check_draft_model(draft_model: torch.nn.Module, target_model: torch.nn.Module, max_model_len: int) -> None:
    """A draft model must speak the target's token ids, hold the engine's context, and sit where the target does."""
    draft_cfg, target_cfg = draft_model.config, target_model.config
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise PosttrainError(
            f"speculative draft model: vocab_size {draft_cfg.vocab_size} differs from the target's "
            f"{target_cfg.vocab_size}; a draft model needs the target's tokenizer"
        )
    if draft_cfg.max_position_embeddings < max_model_len:
        raise PosttrainError(
            f"speculative draft model: max_position_embeddings {draft_cfg.max_position_embeddings} is below the "
            f"engine's max_model_len {max_model_len}; lower max_model_len"
        )
    draft_param, target_param = next(draft_model.parameters()), next(target_model.parameters())
    if draft_param.device != target_param.device:
        raise PosttrainError(
            f"speculative draft model is on {draft_param.device} but the target is on {target_param.device}"
        )

"""LLMEngine: requests in (token ids), one scheduling + forward + sampling step at a time, outputs out.

Text appears here only to apply stop strings and to fill `CompletionOutput.text` (through the
tokenizer, when one is given; each request's texts and detokenizers live in request_state.py); the scheduler,
block manager and runner see token ids only.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from posttrain.engine.bf16_weights import resolve_compute_dtype
from posttrain.engine.block_manager import BlockManager
from posttrain.engine.chained_steps import chain_draws, chain_length, halting_tokens
from posttrain.engine.config import EngineConfig
from posttrain.engine.device_memory import free_device_memory
from posttrain.engine.outputs import RequestOutput
from posttrain.engine.prompt_logprobs import PromptLogprobs
from posttrain.engine.request_state import EngineRequest
from posttrain.engine.runner import ModelRunner
from posttrain.engine.sampler import make_generator
from posttrain.engine.sampling_params import SamplingParams
from posttrain.engine.scheduler import ScheduledBatch, Scheduler
from posttrain.engine.sequence import Sequence
from posttrain.engine.speculative.decoder import build_speculative_decoder
from posttrain.engine.stop import find_stop, truncate_at_stop
from posttrain.engine.weights_lock import WeightsLock
from posttrain.errors import PosttrainError


class LLMEngine:
    """A continuous-batching engine over a live model module: it computes with the module's own weights (on CPU
    through packed copies that follow every change, posttrain/engine/packed_weights.py; in bf16 over fp32 weights
    through bf16 copies that do the same, posttrain/engine/bf16_weights.py). `compute_dtype`: what its forwards
    compute in and its KV pool holds (EngineConfig.compute_dtype resolved). `draft_model`: the draft model of
    `config.speculative` with method "draft", when given as a module rather than a path."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        *,
        draft_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        model_cfg = model.config
        self.max_model_len = self.config.max_model_len or model_cfg.max_position_embeddings
        weights = next(model.parameters())
        self.compute_dtype = resolve_compute_dtype(self.config.compute_dtype, weights.dtype, weights.device)
        self.num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(self.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(model, self.config, self.num_blocks, self.compute_dtype)
        self.eos_token_ids = self._eos_token_ids()
        # Speculative decoding (posttrain/engine/speculative); None when config.speculative is off.
        self.speculator = build_speculative_decoder(
            self.config, model, self.block_manager, self.max_model_len, self.eos_token_ids, draft_model
        )
        self.policy_version = 0
        # Held by every step (its forward reads the weights) and by `weights_updated`; a trainer that updates the
        # weights while another thread steps the engine holds it around its optimizer step and the
        # weights_updated() after it, so weights change only between engine steps, never inside a forward.
        # A waiting trainer goes before the next engine step (engine/weights_lock.py).
        self.weights_lock = WeightsLock()
        # Called at the start of every step, in the thread that steps the engine (async RL in one process: the
        # rollout thread takes its share of the cores there, rollout/core_share.py).
        self.before_step: list[Callable[[], None]] = []
        # Entered by whoever drives the engine around a wait in which it steps nothing: scoring a collected batch,
        # an episode loop waiting on its environment workers (async RL: the rollout side counts as idle there, so
        # the update takes every core, rollout/core_share.py). A no-op by default.
        self.waiting: Callable[[], AbstractContextManager[None]] = nullcontext
        self.requests: dict[str, EngineRequest] = {}
        self.asleep = False
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_processed_tokens = 0  # tokens through the model (prefill + decode), for throughput figures
        self._seed_rng = random.Random(0)

    # ---- sizing -----------------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        element = torch.empty(0, dtype=self.compute_dtype).element_size()
        block_bytes = self.model.config.kv_bytes_per_token(element) * cfg.block_size
        device = next(self.model.parameters()).device
        budget = cfg.kv_cache_bytes or int(cfg.kv_cache_memory_fraction * free_device_memory(device))
        num_blocks = budget // block_bytes
        needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)  # more is never useful
        num_blocks = min(num_blocks, needed)
        if num_blocks < 1:
            raise PosttrainError(
                f"KV cache budget of {budget} bytes holds no {cfg.block_size}-token block "
                f"({block_bytes} bytes); raise kv_cache_bytes or kv_cache_memory_fraction"
            )
        return num_blocks

    def _eos_token_ids(self) -> set[int]:
        ids = getattr(self.tokenizer, "eos_token_ids", None)
        if ids:
            return set(ids)
        eos = self.model.config.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {eos}

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        stream: bool = False,
    ) -> None:
        """Queue a request. With stream=True, `step()` reports it after every step that gives it tokens
        (cumulative outputs); otherwise only when it finishes."""
        params = params or SamplingParams()
        self.check_request(request_id, prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, self._generator(params, 0), num_forks=params.n - 1)
        request = EngineRequest(
            request_id, prompt, list(prompt_token_ids), params, stream, [seq] + [None] * (params.n - 1)
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = seq.prompt_logprobs = PromptLogprobs(
                len(prompt_token_ids), params.prompt_logprobs, params.prompt_logprobs_from, params.prompt_logprob_ranks
            )
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise PosttrainError for a request that is malformed or could never run to completion."""
        if self.asleep:
            raise PosttrainError("the engine is asleep (its KV pool is freed): call wake() first")
        if request_id in self.requests:
            raise PosttrainError(f"request_id {request_id!r} is already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise PosttrainError(
                f"request {request_id!r}: params must be a SamplingParams, got {type(params).__name__}"
            )
        n_tokens = len(prompt_token_ids)
        if n_tokens == 0:
            raise PosttrainError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = next(
            (t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None
        )
        if bad is not None:
            raise PosttrainError(f"request {request_id!r}: prompt token id {bad!r} is not in [0, {vocab})")
        if params.max_tokens == 0 and n_tokens > self.max_model_len:  # prefill only: the prompt may fill it
            raise PosttrainError(
                f"request {request_id!r}: prompt of {n_tokens} tokens is longer than max_model_len={self.max_model_len}"
            )
        if params.max_tokens != 0 and n_tokens >= self.max_model_len:
            raise PosttrainError(
                f"request {request_id!r}: prompt of {n_tokens} tokens leaves no room to generate "
                f"within max_model_len={self.max_model_len}"
            )
        if params.n > self.config.max_num_seqs:
            raise PosttrainError(
                f"request {request_id!r}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}"
            )
        if params.stop and self.tokenizer is None:
            raise PosttrainError(f"request {request_id!r}: stop strings need a tokenizer (the engine has none)")
        new_tokens = self.max_model_len if params.max_tokens is None else params.max_tokens
        longest = min(n_tokens + new_tokens, max(n_tokens, self.max_model_len))
        blocks = self.block_manager.blocks_for_tokens(longest)
        if blocks > self.num_blocks:
            raise PosttrainError(
                f"request {request_id!r} can never fit: one sample needs up to {blocks} KV blocks "
                f"({n_tokens} prompt + {longest - n_tokens} new tokens) but the pool has {self.num_blocks}; "
                f"give the engine more KV memory (num_kv_blocks / kv_cache_bytes) or lower max_tokens"
            )

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None  # drawn together with the other unseeded rows from torch's default generator
        return make_generator(params.seed + index, self.runner.device)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def num_unfinished_samples(self, request_id: str) -> int:
        """Samples of the request still generating (its n before its prompt is prefilled); 0 once finished."""
        request = self.requests.get(request_id)
        if request is None:
            return 0
        return sum(1 for seq in request.seqs if seq is None or not seq.is_finished)

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report finished (and streaming) requests."""
        for hook in self.before_step:
            hook()
        with self.weights_lock.engine_step():
            if self.speculator is None:
                return self._step()
            start = time.perf_counter()
            outputs = self._step()
            self.speculator.step_took(time.perf_counter() - start)  # what a draft row costs (draft_length.py)
            return outputs

    def _step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.scheduler.has_unfinished():  # cannot happen: check_request refuses what cannot fit
                raise RuntimeError("engine stalled: no sequence could be scheduled")
            return []
        try:
            if self.speculator is not None:
                self.speculator.add_drafts(batch)
            # chained decode steps (chained_steps.py) where the batch allows them and nothing waits to be admitted
            if not self.scheduler.waiting and not any(seq.draft_token_ids for seq in batch.seqs):
                outputs = self._chained_steps(batch)
                if outputs is not None:
                    return outputs
            out = self.runner.execute(batch)
        except BaseException:
            # Blocks published for this step hold no valid K/V now.
            self.block_manager.reset_prefix_cache()
            self.runner.attention_workspace.release()
            if self.speculator is not None:
                self.speculator.discard(batch)
            raise
        self.num_steps += 1
        self.num_processed_tokens += batch.num_batched_tokens
        groups: list[list[Sequence]] = []  # group i: the sequences that draw from logits row group_rows[i]
        group_rows: list[int] = []
        checking: list[tuple[Sequence, int]] = []  # sequences with drafts to check, and their first logits row
        row = 0
        for seq, num_new, chunk in zip(batch.seqs, batch.num_new_tokens, out.prompt_logprobs):
            if chunk is not None:
                seq.prompt_logprobs.add(chunk)
            if seq.draft_token_ids:  # its 1 + k rows check the drafts (speculative decoding)
                checking.append((seq, row))
                row += num_new
                continue
            seq.num_cached_tokens += num_new
            if seq.num_cached_tokens == seq.num_tokens:
                groups.append([seq, *self._fork(seq)] if seq.num_forks else [seq])
                group_rows.append(row)
                row += 1
        if not groups and not checking:
            return []
        touched: dict[str, EngineRequest] = {}
        if checking:
            self._append_checked(out.logits, checking, touched)
        drawing: list[int] = []  # the groups that draw a token now
        for i, group in enumerate(groups):
            if group[0].params.max_tokens == 0:  # the prefill was all the request wanted
                for seq in group:
                    touched[seq.request_id] = self._end_without_output(seq)
            else:
                drawing.append(i)
        if drawing:
            if checking:
                logits = out.logits[[group_rows[i] for i in drawing]]  # (R', V)
            else:
                logits = out.logits if len(drawing) == len(groups) else out.logits[drawing]  # (R', V)
            self._draw(logits, [groups[i] for i in drawing], touched)
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, EngineRequest]) -> list[RequestOutput]:
        """The step's outputs: the requests it finished, and the streaming ones it appended to."""
        outputs = []
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
                outputs.append(request.output())
            elif request.stream:
                outputs.append(request.output())
        if not self.requests:  # idle: staged K/V copies and packed weights are not needed until the next wave
            self.runner.release_step_buffers()
            if self.speculator is not None:
                self.speculator.release()
        return outputs

    def _chained_steps(self, batch: ScheduledBatch) -> list[RequestOutput] | None:
        """Run the decode batch as up to `decode_steps` chained steps in one native call and append each sequence's
        tokens; None, having changed nothing but the blocks it made room in, where it does not qualify
        (chained_steps.py) or the native step cannot take it."""
        steps = chain_length(batch, self.config.decode_steps, self.max_model_len)
        if steps == 1:
            return None
        bm, seqs = self.block_manager, batch.seqs
        reserve = self.config.reserve_blocks(bm.num_blocks)  # as the scheduler and draft checks leave free
        if sum(bm.num_new_blocks(seq, steps) for seq in seqs) + reserve > bm.num_free_blocks:
            return None  # short of blocks: one step at a time, which the scheduler makes room for
        for seq in seqs:
            bm.allocate(seq, steps)  # the first token's block is in place: the later ones' new blocks
        draws = chain_draws(seqs, steps)
        halt = halting_tokens(seqs, self.eos_token_ids)
        try:
            ran = self.runner.execute_chained_steps(batch, steps, halt, draws.temperatures, draws.uniforms)
        except BaseException:
            draws.rewind(0)
            raise
        draws.rewind(0 if ran is None else ran[0].shape[0])
        if ran is None:
            return None
        tokens, logits, logprobs = ran  # (n, S), (n, S, V), (n, S)
        n = tokens.shape[0]
        self.num_steps += 1
        if self.speculator is not None:
            self.speculator.chained(n)
        self.num_processed_tokens += n * len(seqs)
        top = None
        if draws.greedy:  # the sampler's own logprobs over each sequence's n rows in turn: what n plain steps report
            rows = [[seq] for seq in seqs for _ in range(n)]
            drawn = self.runner.sample(logits.transpose(0, 1).reshape(n * len(seqs), -1), rows, set())
            logprobs, top = drawn.logprobs.view(len(seqs), n).T, drawn.top_logprobs
        # (the sampled rows' logprobs are sampler.c's, as the one-step sampler's native draw reports them)
        # the tokens the chain fed forward (the sampler's argmax over the same rows is the same first maximum)
        token_ids, logprob_values = tokens.T.tolist(), logprobs.T.tolist()  # (S, n) each
        touched: dict[str, EngineRequest] = {}
        for i, seq in enumerate(seqs):
            appended = [(token_ids[i][j], logprob_values[i][j], top[i * n + j] if top else None) for j in range(n)]
            self._append_computed(seq, appended, touched)
        return self._outputs(touched)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent ends its prefill: make its n-1 siblings, sharing every block of the prompt."""
        request = self.requests[parent.request_id]
        children = [parent.fork(i, self._generator(parent.params, i)) for i in range(1, parent.num_forks + 1)]
        parent.num_forks = 0
        self.scheduler.add_forks(parent, children)
        for child in children:
            request.seqs[child.index] = child
        return children

    def _draw(self, logits: torch.Tensor, groups: list[list[Sequence]], touched: dict[str, EngineRequest]) -> None:
        """Sample one token for every sequence of `groups` (group i from logits row i) and append it."""
        drawn = self.runner.sample(logits, groups, self.eos_token_ids)
        token_ids, logprobs = drawn.token_ids.tolist(), drawn.logprobs.tolist()
        top = drawn.top_logprobs
        for row, seq in enumerate(seq for group in groups for seq in group):
            request = self.requests[seq.request_id]
            self._append_token(request, seq, token_ids[row], logprobs[row], top[row] if top is not None else None)
            touched[seq.request_id] = request
        self.num_generated_tokens += len(token_ids)

    def _append_checked(
        self, logits: torch.Tensor, checking: list[tuple[Sequence, int]], touched: dict[str, EngineRequest]
    ) -> None:
        """Append what the speculative check kept for each sequence: its accepted drafts, then the target's token.
        Each accepted draft's K/V was computed by this step, so the sequence's cached tokens (and the prefix-cache
        blocks they fill) move up with it; the blocks that held only rejected positions are given back."""
        appended = self.speculator.verify(logits, checking)
        for (seq, _), tokens in zip(checking, appended):
            self._append_computed(seq, tokens, touched)

    def _append_computed(self, seq: Sequence, tokens: list, touched: dict[str, EngineRequest]) -> None:
        """Append `tokens` ((token, logprob, top logprobs) each) to seq, one at a time until one ends it. This step
        computed the K/V of seq's last token and of every appended token but the last, so its cached tokens (and
        the prefix-cache blocks they fill) move up with them; blocks past what it keeps are given back."""
        request = self.requests[seq.request_id]
        touched[seq.request_id] = request
        start = seq.num_cached_tokens  # the position of the last token, whose K/V this step computed
        for i, (token, logprob, top) in enumerate(tokens):
            self.block_manager.publish(seq, start + 1 + i)
            seq.num_cached_tokens = start + 1 + i
            self._append_token(request, seq, token, logprob, top)
            self.num_generated_tokens += 1
            if seq.is_finished:
                break
        if not seq.is_finished:
            self.block_manager.truncate(seq, seq.num_tokens)

    def _end_without_output(self, seq: Sequence) -> EngineRequest:
        """Finish a max_tokens=0 sequence at the end of its prefill, with no token."""
        request = self.requests[seq.request_id]
        self._start_output(request, seq)
        request.texts[seq.index] = ""
        self.scheduler.finish(seq, "length")
        return request

    def _start_output(self, request: EngineRequest, seq: Sequence) -> None:
        """The prompt is done: record the weights in force and (once per request) the prefix-cache hits."""
        seq.policy_version = self.policy_version
        if seq.index == 0:
            request.num_cached_tokens = seq.num_cache_hit_tokens

    def _append_token(self, request: EngineRequest, seq: Sequence, token: int, logprob: float, top: Any) -> None:
        params = seq.params
        if seq.num_output_tokens == 0:
            self._start_output(request, seq)
        seq.token_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.output_policy_versions.append(self.policy_version)
        if top is not None:
            seq.output_top_logprobs.append(top)
        num_out = seq.num_output_tokens
        reason: str | None = None
        stop_reason: int | str | None = None
        stop_token = False
        if num_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                reason, stop_token = "stop", True
            elif token in params.stop_token_ids:
                reason, stop_reason, stop_token = "stop", token, True
        if reason is None and (num_out == params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        detok = request.detokenizer(seq, self.tokenizer)
        if detok is not None:
            delta = "" if stop_token else detok.add(token)  # a stop token's text is never shown
            if reason is not None:
                delta += detok.flush()  # the sequence ends: emit any held-back partial character
            if params.stop and num_out >= params.min_tokens:
                found = find_stop(detok.text, params.stop, len(delta))
                if found is not None:
                    request.texts[seq.index] = truncate_at_stop(detok.text, *found, params.include_stop_str_in_output)
                    reason, stop_reason = "stop", found[1]
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
            if request.texts[seq.index] is None:
                request.texts[seq.index] = request.final_text(seq, self.tokenizer, drop_last=stop_token)

    def current_text(self, request_id: str, index: int) -> str:
        """The text of a running sample so far ('' without a tokenizer)."""
        return self.requests[request_id].current_text(index)

    # ---- weights and memory ---------------------------------------------------------------------------

    def weights_updated(self, keep_running_kv: bool = False) -> int:
        """The module's weights changed in place: forget every cached prefix and bump the policy version.
        Returns the new version. The tokens running sequences drew so far keep the version they were drawn under
        (`CompletionOutput.token_policy_versions`); no block computed under the old weights is ever served to
        another sequence again.

        Running sequences: by default they are preempted and recompute their K/V under the new weights (a
        prefill of everything they hold). `keep_running_kv=True`: they go on decoding over the K/V they have
        (PipelineRL's in-flight update: the next tokens are drawn by the new weights attending over keys and
        values the old weights computed), which saves that prefill; their blocks are never published to the
        prefix cache."""
        with self.weights_lock:
            if keep_running_kv:
                self.scheduler.mark_running_stale()
            else:
                self.scheduler.preempt_all()
            self.block_manager.reset_prefix_cache()
            self.runner.drop_graphs()  # captured graphs hold parameter addresses, which an update may change
            self.runner.release_weight_copies()
            self.policy_version += 1
            return self.policy_version

    def touch_kv_cache(self) -> None:
        """Fault in every page of the KV pool now. The pool comes on fresh pages that the OS zeroes as they are
        first touched (posttrain.cpu_malloc.zeroed_pages), so the first steps to reach a page pay for it; a benchmark
        calls this in its warm-up to measure the steady state. Zeros are written over every block, so the prefix
        cache goes too. Only between requests."""
        if self.requests:
            raise PosttrainError(f"cannot touch the KV pool with {len(self.requests)} unfinished requests")
        self.block_manager.reset_prefix_cache()
        with torch.inference_mode():  # the pool was made under it
            for cache in self.runner.kv_caches or []:
                cache.zero_()

    def sleep(self) -> None:
        """Free the KV pool (and the prefix cache with it). Only between requests."""
        if self.requests:
            raise PosttrainError(f"cannot sleep with {len(self.requests)} unfinished requests; finish or abort them")
        if self.asleep:
            return
        self.block_manager.reset_prefix_cache()
        self.runner.free_kv_cache()
        self.runner.release_step_buffers()
        self.runner.release_weight_copies()
        if self.speculator is not None:
            self.speculator.free_kv_cache()
        self.asleep = True

    def wake(self) -> None:
        """Allocate the KV pool again (empty)."""
        if not self.asleep:
            return
        self.runner.allocate_kv_cache()
        if self.speculator is not None:
            self.speculator.allocate_kv_cache()
        self.asleep = False

    # ---- numbers ----------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def attention_backend(self) -> str:
        """The paged-attention kernel the steps run (EngineConfig.attention_backend resolved)."""
        return self.runner.attention_backend

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
            "processed_tokens": self.num_processed_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": bm.num_cache_hit_tokens,
            "kv_blocks": self.num_blocks,
            "free_kv_blocks": bm.num_free_blocks,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }

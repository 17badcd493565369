"""The model runner: a scheduled batch of sequences -> flat tensors -> the model's paged path -> samples.

It owns the KV pool (one zero-initialised tensor per layer) and the device-side work of a step:
copy-on-write block copies, the forward pass, projecting only the rows that sample (and the prompt
positions of requests that asked for prompt logprobs), and sampling.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from posttrain import kernels
from posttrain.cpu_malloc import current_malloc_policy, malloc_policy, set_malloc_policy, zeroed_pages
from posttrain.engine import native_decode, packed_weights
from posttrain.engine.attention_backend import resolve_attention_backend
from posttrain.engine.bf16_weights import Bf16Weights
from posttrain.engine.config import EngineConfig
from posttrain.engine.device_memory import free_device_memory
from posttrain.engine.linear_mode import LinearMode
from posttrain.engine.native_decode import NativeDecode
from posttrain.engine.prompt_logprobs import PromptLogprobChunk, split_by_sequence, token_logprobs_and_top
from posttrain.engine.sampler import SampleOutput, SamplingRow, SamplingWorkspace, sample
from posttrain.engine.scheduler import ScheduledBatch
from posttrain.engine.sequence import Sequence
from posttrain.engine.small_rows_linear import small_rows_linear
from posttrain.errors import PosttrainError
from posttrain.kernels.fused import fused_scope
from posttrain.models.attention import PagedAttentionMetadata
from posttrain.models.paged_workspace import PagedWorkspace

NO_POSITIONS = range(0)


@dataclass
class StepInputs:
    """The flat tensors of one step (N new tokens across S sequences), on the model's device."""

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    meta: PagedAttentionMetadata
    sample_index: torch.Tensor  # (R,) row of the hidden states that each sampling sequence samples from
    prompt: PromptRows | None = None  # the rows that give prompt logprobs; None when no sequence needs any


@dataclass
class PromptRows:
    """The hidden-state rows of a step whose logits give prompt logprobs (M of them, across the batch)."""

    index: torch.Tensor  # (M,) rows of the hidden states
    targets: torch.Tensor  # (M,) the prompt token each row predicts
    counts: list[int]  # rows per sequence of the batch, in batch order
    num_tops: list[int]  # alternatives each sequence asked for
    with_ranks: bool  # some sequence asked for the prompt tokens' ranks


@dataclass
class StepOutput:
    # (R, V) fp32, one row per sequence of the batch that reaches its last token, in batch order; a sequence
    # with drafted tokens has 1 + len(draft_token_ids) consecutive rows (its last token's, then each draft's)
    logits: torch.Tensor
    prompt_logprobs: list[PromptLogprobChunk | None]  # per sequence of the batch, in batch order


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, config: EngineConfig, num_blocks: int, compute_dtype: torch.dtype | None = None
    ) -> None:
        """`compute_dtype`: what the forwards compute in and the KV pool holds (LLMEngine resolves
        EngineConfig.compute_dtype); None: the weights' dtype."""
        self.model = model
        self.config = config
        self.compute_dtype = compute_dtype or self.dtype
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        self.kv_caches: list[torch.Tensor] | None = None
        self.workspace = SamplingWorkspace()
        self.attention_workspace = PagedWorkspace()  # plans, staged K/V and scratch of the paged attention
        if self.tunes_malloc and current_malloc_policy() == "default":
            set_malloc_policy("hold")  # nobody chose: the engine's policy for the whole process, as before
        # The paged-attention kernel every step runs (posttrain/engine/attention_backend.py).
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, self.compute_dtype, self.block_size
        )
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs:
            if self.device.type != "cuda":
                raise PosttrainError(f"cuda_graphs=True needs a model on a CUDA device (it is on {self.device})")
            if (model.config.rope_scaling or {}).get("rope_type") == "dynamic":
                raise PosttrainError("cuda_graphs=True does not support dynamic rope scaling (it syncs on positions)")
            if model.config.moe is not None:
                raise PosttrainError(
                    "cuda_graphs=True does not support mixture-of-experts models (routing syncs on "
                    "the number of tokens per expert)"
                )
        self.allocate_kv_cache()
        # MKL-packed weights for the CPU fp32 forward (posttrain/engine/packed_weights.py); None: plain F.linear.
        self.packed_weights = packed_weights.PackedWeights() if self._packs_weights() else None
        # In fp32 on CPU with the native kernels: a few input rows through their matrix-vector kernel
        # (posttrain/engine/small_rows_linear.py).
        self.small_rows_native = self._small_rows_native()
        # bf16 over fp32 weights: bf16 copies of the linear weights (posttrain/engine/bf16_weights.py), packed for
        # bf16_linear.c with the native kernels.
        packed = self._native_kernels_over_fp32()
        self.bf16_weights = Bf16Weights(packed) if self.compute_dtype != self.dtype else None
        # fp32 weights on CPU with the native kernels, computed in fp32 or bf16: decode steps of a few sequences
        # through one native call for the whole decoder (posttrain/engine/native_decode.py), where the model's
        # structure allows it.
        self.native_decode = (
            NativeDecode(model, self.bf16_weights)
            if self._native_kernels_over_fp32() and config.native_decode_step and native_decode.supports_model(model)
            else None
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _packs_weights(self) -> bool:
        """CPU fp32 with MKL, and the packed copy takes at most half the memory left after the KV pool."""
        fp32 = self.dtype == torch.float32 and self.compute_dtype == torch.float32
        if not (self.config.pack_cpu_weights and self.device.type == "cpu" and fp32):
            return False
        copy_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.dim() == 2)
        return packed_weights.available() and 2 * copy_bytes <= free_device_memory(self.device)

    @property
    def tunes_malloc(self) -> bool:
        return self.config.tune_cpu_allocator and self.device.type == "cpu"

    def malloc_scope(self) -> AbstractContextManager[None]:
        """Around a run of engine steps: glibc's `hold` policy (posttrain.cpu_malloc), and after it the
        process's own again, e.g. a trainer's `release` for its update."""
        return malloc_policy("hold") if self.tunes_malloc else nullcontext()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---- KV pool ----------------------------------------------------------------------------------

    def allocate_kv_cache(self) -> None:
        cfg = self.model.config
        # With CUDA graphs one extra block, never handed out, takes the writes of padding rows.
        num_blocks = self.num_blocks + (1 if self.config.cuda_graphs else 0)
        # (2, blocks, block_size, Hkv, D) for K and V, or (1, ..., 1, latent) for latent attention: the
        # block axis is 1 either way, which is all copy_blocks and the graphs rely on.
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        # Zeros, not empty: unused slots are masked, but 0 * NaN garbage would still poison the sums.
        with torch.inference_mode():
            self.kv_caches = [self._zeroed_cache(shape) for _ in range(cfg.num_hidden_layers)]
        if self.config.cuda_graphs:
            max_blocks = -(-self.model_max_len // self.block_size)
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.config.max_num_seqs,
                max_blocks,
                scratch_block=self.num_blocks,
                block_size=self.block_size,
                attention_backend=self.attention_backend,
            )

    def _zeroed_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":  # zero pages the OS fills on first touch, 2 MiB ones (posttrain.cpu_malloc)
            return zeroed_pages(shape, self.compute_dtype)
        return torch.zeros(shape, dtype=self.compute_dtype, device=self.device)

    def free_kv_cache(self) -> None:
        self.kv_caches = None
        self.graphs = None  # they point into the freed pool
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_graphs(self) -> None:
        """Forget captured graphs (they hold the addresses of the parameters); recaptured when next needed."""
        if self.graphs is not None:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.graphs.max_seqs,
                self.graphs.max_blocks,
                self.graphs.scratch_block,
                self.block_size,
                self.attention_backend,
            )

    @property
    def model_max_len(self) -> int:
        return self.config.max_model_len or self.model.config.max_position_embeddings

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K/V in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    # ---- one step -----------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        context_lens: list[int] = []
        prompt_positions: list[range] = []  # per sequence: the positions whose logits give prompt logprobs
        prompt_rows: list[int] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_cached_tokens
            end = start + num_new
            table = seq.block_table
            wanted = (
                NO_POSITIONS if seq.prompt_logprobs is None else seq.prompt_logprobs.positions_to_compute(start, end)
            )
            prompt_positions.append(wanted)
            if wanted:  # their rows: this sequence's rows start at len(input_ids), for position `start`
                prompt_rows.extend(range(len(input_ids) + wanted.start - start, len(input_ids) + wanted.stop - start))
            if num_new == 1:  # decode: the hot path
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                if end > seq.num_tokens:  # drafted tokens follow the sequence's last one (speculative decoding)
                    input_ids.extend(seq.draft_token_ids)
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            if end == seq.num_tokens:
                sample_index.append(len(input_ids) - 1)
            elif end > seq.num_tokens:  # the last token's row and each draft's: every one checks the next draft
                sample_index.extend(range(len(input_ids) - 1 - len(seq.draft_token_ids), len(input_ids)))
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        device = self.device
        # On CUDA from pinned host memory, so the copies really are asynchronous (torch's caching host
        # allocator keeps each pinned buffer alive until its copy is done).
        pinned = device.type == "cuda"

        def as_tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=True)

        meta = PagedAttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables),
            context_lens=as_tensor(context_lens),
            query_lens=as_tensor(batch.num_new_tokens),
            max_query_len=max(batch.num_new_tokens),
            workspace=self.attention_workspace,
            native_kernels=self.config.cpu_kernels,
            backend=self.attention_backend,
        )
        prompt = None
        if prompt_rows:
            targets = [seq.token_ids[p + 1] for seq, wanted in zip(batch.seqs, prompt_positions) for p in wanted]
            num_tops = [0 if seq.prompt_logprobs is None else seq.prompt_logprobs.num_top for seq in batch.seqs]
            with_ranks = any(seq.prompt_logprobs is not None and seq.prompt_logprobs.with_ranks for seq in batch.seqs)
            prompt = PromptRows(
                as_tensor(prompt_rows), as_tensor(targets), [len(w) for w in prompt_positions], num_tops, with_ranks
            )
        return StepInputs(as_tensor(input_ids), as_tensor(positions), meta, as_tensor(sample_index), prompt)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run the forward pass of one step: fp32 logits (R, V), one row per sequence of the batch that
        reaches its last token (in batch order), the rows to sample from; and the step's prompt logprobs."""
        self.copy_blocks(batch.blocks_to_copy)
        inputs = self.prepare(batch)
        hidden = None  # (N, d)
        # Outside the weights' TorchFunctionMode, which would see every pointer read of the native step's checks.
        if self.native_decode is not None and self.native_decode.can_run(inputs.input_ids, inputs.meta):
            hidden = self.native_decode.run(inputs.input_ids, inputs.positions, inputs.meta)
        with self._weights_scope():
            if hidden is not None:
                pass
            elif self.graphs is not None and self.graphs.can_run(inputs.meta):
                hidden = self.graphs.run(inputs)
            else:
                fused = fused_scope() if self.config.cpu_kernels else nullcontext()
                with fused:  # fused elementwise ops on CPU (posttrain.kernels.fused)
                    hidden = self.model.hidden_states(
                        inputs.input_ids, positions=inputs.positions, attn_meta=inputs.meta
                    )
            if inputs.sample_index.numel() == 0:
                logits = hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
            else:
                logits = self.model.logits(hidden.index_select(0, inputs.sample_index))  # (R, V)
        return StepOutput(logits, self._prompt_logprobs(hidden, inputs.prompt, len(batch.seqs)))

    @torch.inference_mode()
    def execute_chained_steps(
        self, batch: ScheduledBatch, steps: int, halt: list[int], temperatures: list[float], uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Up to `steps` chained decode steps of a decode batch in one native call (chained_steps.py), over blocks
        already allocated for them (`NativeDecode.run_chained_steps`: temperatures (S,), 0 for argmax; uniforms
        (steps, S) fp64). Returns tokens (n, S), their fp32 logits (n, S, V) and the sampled rows' logprobs (n, S),
        n the steps run; None, having run nothing, where the native decode step cannot take the batch with its head."""
        if self.native_decode is None:
            return None
        inputs = self.prepare(batch)
        native = self.native_decode
        if not (native.can_run(inputs.input_ids, inputs.meta) and native.can_run_chain()):
            return None
        self.copy_blocks(batch.blocks_to_copy)
        return native.run_chained_steps(
            inputs.input_ids, inputs.positions, inputs.meta, steps, halt, temperatures, uniforms
        )

    def _weights_scope(self) -> AbstractContextManager:
        """Around the forward: the linear layers through bf16 copies; or in fp32 on CPU, a few rows through the
        native matrix-vector kernel (small_rows_linear.py) and more through MKL-packed weights; or as they are."""
        if self.bf16_weights is not None:
            return self.bf16_weights.scope()
        if self.small_rows_native:
            return LinearMode(self._fp32_linear)
        return self.packed_weights.scope() if self.packed_weights is not None else nullcontext()

    def _small_rows_native(self) -> bool:
        return self.compute_dtype == torch.float32 and self._native_kernels_over_fp32()

    def _native_kernels_over_fp32(self) -> bool:
        """fp32 weights on CPU with the native kernels (computed in fp32, or in bf16 through bf16 copies)."""
        cpu = self.device.type == "cpu" and self.config.cpu_kernels
        return self.dtype == torch.float32 and cpu and kernels.library() is not None

    def _fp32_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        out = small_rows_linear(x, weight, bias)
        if out is None and self.packed_weights is not None:
            out = self.packed_weights.linear(x, weight, bias)
        return out

    def release_step_buffers(self) -> None:
        """Free what the engine keeps between steps only for speed: the attention's staged K/V and scratch
        buffers and the packed weights (the engine calls it when idle, asleep, or after a failed step)."""
        self.attention_workspace.release()
        self.release_packed_weights()

    def release_packed_weights(self) -> None:
        """Drop the packed weight copies (rebuilt on demand): when the engine goes idle or the weights change."""
        if self.packed_weights is not None:
            self.packed_weights.clear()

    def release_weight_copies(self) -> None:
        """Drop the packed and the bf16 weight copies (remade on demand): when the weights change or the engine
        sleeps. (The bf16 copies outlive idle spells: remaking them costs a pass over every weight.)"""
        self.release_packed_weights()
        if self.bf16_weights is not None:
            self.bf16_weights.clear()
        if self.native_decode is not None:
            self.native_decode.clear()

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: PromptRows | None, num_seqs: int
    ) -> list[PromptLogprobChunk | None]:
        """Project only the rows that give prompt logprobs, in bounded chunks. hidden (N, d)."""
        if rows is None:
            return [None] * num_seqs
        logprobs, ranks, top_values, top_ids = token_logprobs_and_top(
            self.model, hidden.index_select(0, rows.index), rows.targets, max(rows.num_tops), rows.with_ranks
        )
        return split_by_sequence(logprobs, ranks, top_values, top_ids, rows.counts, rows.num_tops)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, groups: list[list[Sequence]], eos_token_ids: set[int]) -> SampleOutput:
        """groups[i]: the sequences that draw from logits row i (a parent ending its prefill and its forks
        draw n tokens from one row). Returns one draw per sequence, in the flattened order of groups."""
        counts = [len(group) for group in groups]
        if any(c != 1 for c in counts):
            repeat = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(counts)).to(logits.device)
            logits = logits.index_select(0, repeat)  # (sum(counts), V)
        rows = [
            SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, eos_token_ids)
            for group in groups
            for seq in group
        ]
        if any(row.params.logits_processors for row in rows):
            logits = _processed(logits, rows)
        return sample(logits, rows, self.workspace, native_kernels=self.config.cpu_kernels)


def _processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits (R, V) with each row's logits processors applied to its row, on a copy (the step's logits may be
    a view that others read)."""
    logits = logits.clone()
    for i, row in enumerate(rows):
        for process in row.params.logits_processors:
            logits[i] = process(row.output_token_ids, logits[i])
    return logits


class DecodeGraphs:
    """CUDA graphs of the decode forward pass (one new token per sequence), captured lazily per
    (batch bucket, block-table width bucket). Inputs are copied into static buffers; rows that pad the
    batch up to its bucket write their K/V into a scratch block and attend only it.

    Not exercised by the CPU test suite: enable with EngineConfig(cuda_graphs=True) on CUDA only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_seqs: int,
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        attention_backend: str | None = None,
    ) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.kv_caches = kv_caches
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        device = kv_caches[0].device
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_seqs, **long)
        self.positions = torch.zeros(max_seqs, **long)
        self.slot_mapping = torch.full((max_seqs,), self.scratch_slot, **long)
        self.context_lens = torch.ones(max_seqs, **long)
        self.query_lens = torch.ones(max_seqs, **long)
        self.block_tables = torch.full((max_seqs, max_blocks), scratch_block, **long)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @staticmethod
    def bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())

    def can_run(self, meta: PagedAttentionMetadata) -> bool:
        S, W = meta.block_tables.shape
        return meta.max_query_len == 1 and S <= self.max_seqs and W <= self.max_blocks

    def run(self, inputs: StepInputs) -> torch.Tensor:
        meta = inputs.meta
        S, W = meta.block_tables.shape
        Sb, Wb = min(self.bucket(S), self.max_seqs), min(self.bucket(W), self.max_blocks)
        self.input_ids[:S].copy_(inputs.input_ids)
        self.positions[:S].copy_(inputs.positions)
        self.slot_mapping[:S].copy_(meta.slot_mapping)
        self.context_lens[:S].copy_(meta.context_lens)
        self.block_tables[:S, :W].copy_(meta.block_tables)
        self.block_tables[:S, W:Wb].fill_(self.scratch_block)
        # Rows S..Sb pad the bucket: position 0, context 1, their K/V in the scratch slot.
        self.input_ids[S:Sb].zero_()
        self.positions[S:Sb].zero_()
        self.slot_mapping[S:Sb].fill_(self.scratch_slot)
        self.context_lens[S:Sb].fill_(1)
        self.block_tables[S:Sb, :Wb].fill_(self.scratch_block)
        key = (Sb, Wb)
        if key not in self.graphs:
            self.graphs[key] = self._capture(Sb, Wb)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:S]

    def _capture(self, Sb: int, Wb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        def forward() -> torch.Tensor:
            # A fresh metadata object per call: a kernel's per-step plan (meta.cached_plan) made in the
            # warm-up must not stand in for the one the graph computes from its static buffers.
            meta = PagedAttentionMetadata(
                self.kv_caches,
                self.slot_mapping[:Sb],
                self.block_tables[:Sb, :Wb],
                self.context_lens[:Sb],
                self.query_lens[:Sb],
                max_query_len=1,
                backend=self.attention_backend,
            )
            return self.model.hidden_states(self.input_ids[:Sb], positions=self.positions[:Sb], attn_meta=meta)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy cuBLAS / kernel init)
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward()
        self.pool = graph.pool()
        return graph, hidden

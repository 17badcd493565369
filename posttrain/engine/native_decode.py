"""The decoder of a decode step with a few rows in one native call (posttrain/kernels/decode_step.c).

Why: at batch 1 a token's time is its weights' bytes (~30 ms for SmolLM2-135M in fp32 on a 2-core AVX2 machine)
plus the module path's Python: ~210 linear layers and ~150 fused ops a token, each a module call, a dispatch through
the runner's TorchFunctionMode (which sees ~3800 torch calls a token), checks and a fresh tensor (~14 ms). Here the
embedding and the rotary tables come from the modules; every layer and the final norm run in C, over the same
kernels in the same order, so a decode step's hidden states are bit for bit the module path's.

When: the runner's CPU forward over fp32 weights with the native kernels (EngineConfig.cpu_kernels,
native_decode_step), a step of at most MAX_ROWS new tokens, with every layer of a kind this step knows: a dense
Llama-family decoder (grouped-query attention, optional q/k norms and q/k/v biases, SwiGLU; no sliding window,
latent attention or experts) whose linear layers are plain fp32 `nn.Linear`s or int8 `QuantizedLinear`s on
posttrain's int8 kernels (int8_linear.c, or q8_linear.c for the `q8_0` scheme).
Anything else (LoRA wrappers, long prompts, more rows) takes the module path.

bf16 compute (EngineConfig.compute_dtype, bf16 over fp32 weights): the step runs the engine's bf16 copies of the
`nn.Linear` weights (bf16_weights.py; taken through `Bf16Weights.copy_of`, so a copy an optimizer step made stale is
remade before the step reads it) with bf16_linear.c, the kernel the module path's linear layers run too, and
writes and reads the bf16 K/V pool. Since that kernel serves any number of rows, a step whose linear layers are all
bf16 copies takes decode steps (one new token per sequence) of up to BF16_MAX_ROWS rows, not MAX_ROWS.

A step of one new token per sequence attends with the module path's own plan: the result is bit for bit the module
path's. A step with several new tokens per sequence (a speculative check: the last token and k drafts; a prompt of a
few tokens) runs each token as a one-token query over its sequence's blocks (`one_query_per_token`), where the module
path runs masked SDPA: equal to rounding, and at batch 1 each position's logits are bit for bit a plain decode
step's, so a speculative engine's greedy output is exactly the plain one's.

Chained steps (posttrain/engine/chained_steps.py): where the table also takes the LM head and the embedding (a head
of a kind `_fill_linear` takes, a plain fp32 embedding, neither hooked), `run_chained_steps` runs several decode steps
in one call, each step's drawn tokens (argmax, or sampler.c's draw) embedded as the next one's input.

The layer table (ctypes structures of weight and K/V pool pointers) is built once and checked at every step against
the model's current modules and tensors, so a LoRA wrapper, a new weight tensor or a reallocated pool rebuilds it; an
optimizer's in-place step changes nothing the table holds (the kernels read the weights where they are), except in
bf16, where it makes a weight's copy stale. The check is a `_Watch` recorded with the table: each module and tensor
still in its place, no hook on them, each tensor's storage (and where the table holds something derived from it, its
version) unchanged, read with map() over C functions: ~0.1 ms a step with its ~2000 objects in cache, ~0.75 ms in a
batch-1 decode loop, where the weights streaming by have evicted them (a token ~10 ms in all), against ~1.5 ms for
the full fingerprint it replays. Only when the watch fails is the fingerprint taken again.
"""

from __future__ import annotations

import ctypes
import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from posttrain import kernels
from posttrain.engine.bf16_weights import Bf16Weights
from posttrain.engine.sampler import SUM_BLOCK
from posttrain.engine.small_rows_linear import MAX_ROWS
from posttrain.models.attention import Attention
from posttrain.models.layers import SwiGLU
from posttrain.models.paged_plan import NativeDecodePlan, plan_for
from posttrain.models.transformer import Transformer
from posttrain.quant.linear import QuantizedLinear, native_int8_operands

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
BF16_WEIGHT = -1  # decode_step.c's DecodeLinear.group of a bf16 weight
# Steps of up to this many rows take the native step when every linear layer is a bf16 copy: bf16_linear.c is the
# module path's kernel at any size, so the step saves the per-layer Python around it; fp32 and int8 layers stop at
# MAX_ROWS, where MKL's GEMM and the int8 kernels' prefill choice take over.
BF16_MAX_ROWS = 512  # the engine's default max_num_seqs: every decode step of a rollout
_PLAIN = (torch.Tensor, nn.Parameter)  # not a tensor subclass (DTensor shards, quantized wrappers): their own ops
_GLOBAL_HOOKS = (module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks)  # nn.Module's, all modules
# the C-level reads _Watch.holds maps over its records
_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")
_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")
_HOOKS = operator.attrgetter("_forward_hooks")
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class _Linear(ctypes.Structure):  # decode_step.c's DecodeLinear
    _fields_ = [
        ("weight", _ptr),
        ("scales", _ptr),
        ("bias", _ptr),
        ("out_features", _i64),
        ("in_features", _i64),
        ("group", _i64),
        ("quantize_input", _i64),
    ]


class _Layer(ctypes.Structure):  # DecodeLayer
    _fields_ = [
        ("input_norm", _ptr),
        ("post_attention_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        *((name, _Linear) for name in ("q", "k", "v", "o", "gate", "up", "down")),
        ("kv_cache", _ptr),
    ]


class _Step(ctypes.Structure):  # DecodeStep
    _fields_ = [
        *((name, _i64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _f32),
        ("scale", _f32),
        ("num_blocks", _i64),
        ("block_size", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("width", _i64),
        ("context_lens", _ptr),
        ("seq_rows", _ptr),
        ("group_starts", _ptr),
        ("group_shared", _ptr),
        ("num_groups", _i64),
        ("max_members", _i64),
        ("kv_bf16", _i64),
    ]


@dataclass
class _Watch:
    """What a table was built from, in a form cheap to check at every step (module docstring)."""

    # (an owner's dict, key, what sat there): modules, parameters and buffers each still in its place
    places: list[tuple[dict, str, object]] = dataclasses.field(default_factory=list)
    modules: list[nn.Module] = dataclasses.field(default_factory=list)  # none of them may gain a forward hook
    # (tensor, its data pointer, its version or -1 where any version will do)
    tensors: list[tuple[torch.Tensor, int, int]] = dataclasses.field(default_factory=list)
    caches: list[int] = dataclasses.field(default_factory=list)  # the K/V pools' data pointers
    hooked: list[nn.Module] = dataclasses.field(default_factory=list)  # left out for their hooks: rebuilt when none
    _flat: tuple = ()  # the lists above as `_layout` lays them out for `holds`, made at its first call

    def _layout(self) -> tuple:
        """The records as parallel sequences, which `holds` walks with map() over C functions: no bytecode per
        entry. A Python loop over the ~2000 entries of SmolLM2's table took ~1 ms a step at batch 1 (the objects
        are out of cache after the weights stream by), a tenth of the step."""
        owners, keys, held = zip(*self.places) if self.places else ((), (), ())
        versioned = [(t, version) for t, _, version in self.tensors if version >= 0]
        return (
            owners,
            keys,
            list(held),
            self.modules,
            [t for t, _, _ in self.tensors],
            [ptr for _, ptr, _ in self.tensors],
            [t for t, _ in versioned],
            [version for _, version in versioned],
            self.hooked,
        )

    def holds(self, caches: list[torch.Tensor]) -> bool:
        if _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or list(map(_DATA_PTR, caches)) != self.caches:
            return False
        if not self._flat:  # the records are complete once the watch is checked: a table was built from them
            self._flat = self._layout()
        owners, keys, held, modules, tensors, pointers, versioned, versions, hooked = self._flat
        return (
            all(map(operator.is_, map(dict.get, owners, keys), held))
            and not any(map(_PRE_HOOKS, modules))
            and not any(map(_HOOKS, modules))
            and list(map(_DATA_PTR, tensors)) == pointers
            and list(map(_VERSION, versioned)) == versions
            and all(map(_hooked, hooked))
        )


@dataclass
class _Table:
    layers: ctypes.Array  # (num_layers,) _Layer
    max_rows: int  # the most rows a step through it takes (BF16_MAX_ROWS when every layer is a bf16 copy)
    fingerprint: list[int]  # what it was built from: module ids and tensor data pointers, in a fixed order
    keep: list[torch.Tensor]  # tensors derived for it (fp32 scales, bf16 copies), kept alive while it points at them
    watch: _Watch = dataclasses.field(default_factory=_Watch)  # the same, checked cheaply at every step
    # the LM head as decode_step.c runs it and the (V, d) fp32 embedding, for chained decode steps; None where either
    # is of a kind it does not run (or hooked): then steps go one at a time, the head through the module path
    head: _Linear | None = None
    embedding: torch.Tensor | None = None


def supports_model(model: nn.Module) -> bool:
    """Whether the model's structure is one the native step computes (before looking at its linear layers)."""
    if type(model) is not Transformer:
        return False
    cfg = model.config
    return (
        cfg.mla is None
        and cfg.moe is None
        and all(cfg.attention_window(i) is None for i in range(cfg.num_hidden_layers))
        and cfg.head_dim % kernels.LANES == 0
        and cfg.num_attention_heads % cfg.num_key_value_heads == 0
        and all(type(layer.self_attn) is Attention and type(layer.mlp) is SwiGLU for layer in model.layers)
    )


class NativeDecode:
    """Runs the runner's decode steps of up to MAX_ROWS sequences (BF16_MAX_ROWS in bf16) in one native call where
    it can."""

    def __init__(self, model: Transformer, bf16_weights: Bf16Weights | None = None) -> None:
        """`bf16_weights`: the runner's bf16 copies when the engine computes in bf16 over the fp32 weights (packed:
        decode_step.c reads bf16_linear.c's layout)."""
        if bf16_weights is not None and not bf16_weights.packed:
            raise ValueError("the native decode step reads packed bf16 copies: Bf16Weights(packed=True)")
        self.model = model
        self.bf16 = bf16_weights
        self._table: _Table | None = None
        self.steps = 0  # steps it ran (tests, stats)

    def can_run(self, input_ids: torch.Tensor, meta) -> bool:  # noqa: ANN001 (PagedAttentionMetadata)
        """Whether this step is one the native step takes: pure decode, few rows, a pool the C kernels read (fp32,
        or bf16 when the engine computes in bf16)."""
        rows = input_ids.numel()
        # Only a decode step (one new token per sequence) goes past MAX_ROWS in bf16: a prompt or a speculative check
        # runs each token as a query of its own, equal to the module path's masked SDPA only to rounding.
        decode = meta.max_query_len == 1
        limit = BF16_MAX_ROWS if self.bf16 is not None and decode else MAX_ROWS
        if not (0 < rows <= limit and meta.native_kernels):
            return False
        if meta.backend not in (None, "cpu") or kernels.library() is None:
            return False
        cache = meta.kv_caches[0]
        pool_dtype = torch.bfloat16 if self.bf16 is not None else torch.float32
        if cache.dtype != pool_dtype or not cache.is_contiguous():
            return False
        table = self._current_table(meta, rows)
        return table is not None and rows <= table.max_rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:  # noqa: ANN001
        """The final norm's hidden states (N, d) of the step, as `model.hidden_states` computes them."""
        table = self._table
        x = self.model.embed_tokens(input_ids).contiguous()  # (N, d): the residual stream, updated in place
        cos, sin = self.model.rotary(positions)  # (N, D) each
        slots = meta.slot_mapping.contiguous()
        if meta.max_query_len == 1:  # the module path's plan (groups read their shared blocks once): its very result
            plan = plan_for(meta, meta.kv_caches[0].shape[2], native=True).native_decode
        else:  # a speculative check or a short prompt: each new token a query of its own
            plan = one_query_per_token(meta)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        step, scratch = self._step(x.shape[0], cos, sin, slots, plan, plan.context_lens, meta)
        out = torch.empty_like(x)
        kernels.library().decode_layers(
            ctypes.addressof(table.layers),
            len(table.layers),
            ctypes.addressof(step),
            x.data_ptr(),
            out.data_ptr(),
            self.model.norm.weight.data_ptr(),
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        self.steps += 1
        return out

    def can_run_chain(self) -> bool:
        """Whether the table checked by the last `can_run` also takes the LM head and the embedding, so that
        `run_chained_steps` can chain steps (a head of a kind the step knows, a plain fp32 embedding, no hook)."""
        return self._table is not None and self._table.head is not None

    def run_chained_steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta,  # noqa: ANN001 (PagedAttentionMetadata)
        steps: int,
        halt: list[int],
        temperatures: list[float],
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up to `steps` decode steps of the step `meta` describes (one new token per sequence, M rows) in one native
        call (decode_step.c's decode_chained_steps), each step's drawn tokens feeding the next: row m's argmax where
        temperatures[m] is 0, else the sampler's draw from softmax(logits / temperatures[m]) with uniforms[j, m]
        ((steps, M) fp64). Stops after the step where some row drew a token of `halt`. The block tables must already
        hold room for `steps` new tokens per sequence. Returns tokens (n, M) int64, the fp32 logits they came from
        (n, M, V) and the sampled rows' logprobs (n, M), n the steps run: bit for bit what n one-token steps through
        `run`, the LM head and the sampler give."""
        table, model = self._table, self.model
        M, bs = input_ids.numel(), meta.kv_caches[0].shape[2]
        x = model.embed_tokens(input_ids).contiguous()  # (M, d): the first step's residual stream
        ahead = positions[None, :] + torch.arange(steps)[:, None]  # (steps, M) each step's positions
        # (steps, M) each new token's flat K/V slot: its block's id * block size + its place in the block
        blocks = meta.block_tables.gather(1, (ahead // bs).T).T
        slots = (blocks * bs + ahead % bs).contiguous()
        cos, sin = model.rotary(ahead.reshape(-1))  # (steps * M, D)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        plan = plan_for(meta, bs, native=True).native_decode
        context_lens = plan.context_lens.clone()  # (M,) moved up a step at a time by the call
        step, scratch = self._step(M, cos, sin, slots, plan, context_lens, meta)
        logits = torch.empty(steps, M, table.head.out_features)
        tokens = torch.empty(steps, M, dtype=torch.long)
        logprobs = torch.zeros(steps, M)
        halt_ids = torch.tensor(halt, dtype=torch.long)
        hidden = torch.empty_like(x)  # (M, d) each step's final norm output
        temperature = torch.tensor(temperatures, dtype=torch.float32)
        uniforms = uniforms.to(torch.float64).contiguous()
        ran = kernels.library().decode_chained_steps(
            ctypes.addressof(table.layers),
            len(table.layers),
            ctypes.addressof(step),
            context_lens.data_ptr(),
            ctypes.addressof(table.head),
            table.embedding.data_ptr(),
            model.norm.weight.data_ptr(),
            x.data_ptr(),
            hidden.data_ptr(),
            logits.data_ptr(),
            tokens.data_ptr(),
            logprobs.data_ptr(),
            temperature.data_ptr(),
            uniforms.data_ptr(),
            SUM_BLOCK,
            halt_ids.data_ptr(),
            halt_ids.numel(),
            steps,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        self.steps += ran
        return tokens[:ran], logits[:ran], logprobs[:ran]

    def _step(self, rows: int, cos, sin, slots, plan: NativeDecodePlan, context_lens, meta) -> tuple:  # noqa: ANN001
        """decode_step.c's DecodeStep for `rows` new tokens, and the scratch its layers carve (kept alive together
        with the tensors the structure points at by the caller)."""
        cfg, cache = self.model.config, meta.kv_caches[0]
        d, D, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_size, kv_size = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        wide = max(d, q_size, inner)  # the widest input of a linear layer (a bf16 layer rounds it into scratch)
        scratch = torch.empty(rows * (2 * d + 3 * q_size + 4 * kv_size + 3 * inner + wide))  # decode_step.c carves it
        step = _Step(
            rows,
            d,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            D,
            inner,
            cfg.rms_norm_eps,
            D**-0.5,
            cache.shape[1],
            cache.shape[2],
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            plan.tables.data_ptr(),
            plan.tables.shape[1],
            context_lens.data_ptr(),
            plan.rows.data_ptr(),
            plan.group_starts.data_ptr(),
            plan.group_shared.data_ptr(),
            plan.group_shared.numel(),
            plan.max_members,
            int(self.bf16 is not None),
        )
        return step, scratch

    def clear(self) -> None:
        self._table = None

    # ---- the layer table -------------------------------------------------------------------------------

    def _current_table(self, meta, rows: int) -> _Table | None:  # noqa: ANN001
        """The table for the model as it is now, rebuilt when a module or tensor moved; None where some layer is
        not one the native step computes (then every step checks again: a LoRA wrapper may come off)."""
        if self._table is not None and self._table.watch.holds(meta.kv_caches):
            return self._table
        watch = _Watch()
        fingerprint = self._fingerprint(meta, watch)
        if fingerprint is None:
            return None
        if self._table is None or self._table.fingerprint != fingerprint:
            self._table = self._build(meta, rows, fingerprint)
        if self._table is not None:
            self._table.watch = watch
        return self._table

    def _fingerprint(self, meta, watch: _Watch) -> list[int] | None:  # noqa: ANN001
        """Module ids and tensor pointers (and the quantized layers' versions) in a fixed order, recording into
        `watch` what they were read from; None where a module on the way has forward hooks the native step would
        skip (FSDP2's all-gathers, torchrun's rollout lockstep, a user's) or holds a tensor that is not a plain one
        (a DTensor shard)."""
        if _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or _hooked(self.model):
            return None
        model_modules = self.model._modules
        watch.places.append((model_modules, "layers", model_modules["layers"]))
        watch.modules.append(self.model)
        watch.caches = [cache.data_ptr() for cache in meta.kv_caches]
        prints: list[int] = []
        for index, (layer, cache) in enumerate(zip(self.model.layers, meta.kv_caches)):
            modules = layer._modules  # plain dict reads: nn.Module.__getattr__ costs ~1 us each
            attention, mlp = modules["self_attn"], modules["mlp"]
            norms = (modules["input_layernorm"], modules["post_attention_layernorm"])
            norms += tuple(attention._modules.get(n) for n in ("q_norm", "k_norm"))  # None: not registered
            linears = (*(attention._modules[n] for n in ATTENTION_LINEARS), *(mlp._modules[n] for n in MLP_LINEARS))
            if any(_hooked(m) for m in (layer, attention, mlp, *linears, *norms) if m is not None):
                return None
            watch.places.append((self.model.layers._modules, str(index), layer))
            for owner in (layer, attention, mlp):
                watch.places.extend((owner._modules, name, child) for name, child in owner._modules.items())
            watch.modules.extend(m for m in (layer, attention, mlp, *linears, *norms) if m is not None)
            for linear in linears:
                prints.append(id(linear))
                if type(linear) is nn.Linear:  # an optimizer steps these in place: the kernels read them live
                    tensors = list(linear._parameters.values())
                    if not all(t is None or type(t) in _PLAIN for t in tensors):
                        return None
                    prints.extend(t.data_ptr() if t is not None else 0 for t in tensors)
                    # In bf16 an in-place step makes the weight's copy stale: versions are watched too.
                    _watch_tensors(watch, linear._parameters, versioned=self.bf16 is not None)
                    if self.bf16 is not None:  # the copy, remade here if the weight moved since it was made
                        prints.append(self.bf16.copy_of(linear._parameters["weight"]).data_ptr())
                else:  # frozen codes and scales: a reload writes them in place too, and the table holds derived scales
                    for t in linear._buffers.values():
                        prints.extend((t.data_ptr(), t._version) if t is not None else (0, 0))
                    _watch_tensors(watch, linear._buffers, versioned=True)
            for norm in norms:
                weight = norm._parameters["weight"] if norm is not None else None
                if weight is not None and type(weight) not in _PLAIN:
                    return None
                prints.append(weight.data_ptr() if weight is not None else 0)
                if norm is not None:
                    _watch_tensors(watch, norm._parameters, versioned=False)
            prints.append(cache.data_ptr())
        prints.extend(self._fingerprint_ends(watch))
        return prints

    def _fingerprint_ends(self, watch: _Watch) -> list[int]:
        """The fingerprint's part for the LM head and the embedding (`run_chained_steps`), recorded into `watch` as
        the layers are. A hooked one is left out of the watch (its hook runs on the module path; chained steps would
        skip it) and marked in the fingerprint: the table is built without them."""
        model_modules = self.model._modules
        head, embedding = model_modules.get("lm_head"), model_modules.get("embed_tokens")
        if head is None or embedding is None:
            return [-1]
        watch.places.extend((model_modules, name, model_modules[name]) for name in ("lm_head", "embed_tokens"))
        if _hooked(head) or _hooked(embedding):  # until the hooks come off (the watch sees that)
            watch.hooked.extend(m for m in (head, embedding) if _hooked(m))
            watch.modules.extend(m for m in (head, embedding) if not _hooked(m))
            return [-1]
        watch.modules.extend((head, embedding))
        prints = [id(head), id(embedding)]
        for module in (head, embedding):
            tensors = module._parameters if type(module) is not QuantizedLinear else module._buffers
            prints.extend(t.data_ptr() if t is not None else 0 for t in tensors.values())
            # as for the layers: bf16 copies and a quantized layer's derived scales go stale when these move
            _watch_tensors(watch, tensors, versioned=self.bf16 is not None or type(module) is QuantizedLinear)
        if self.bf16 is not None and type(head) is nn.Linear and _bf16_copyable(head.weight):
            prints.append(self.bf16.copy_of(head.weight).data_ptr())  # the copy, remade here if the weight moved
        return prints

    def _build(self, meta, rows: int, fingerprint: list[int]) -> _Table | None:  # noqa: ANN001
        # What an int8 layer's kernel choice looks at. At most MAX_ROWS rows: a mixed table (int8 layers in a bf16
        # step) first built by a wide step would otherwise hold the int8 choice for that width, which the step never
        # runs (only an all-bf16 table takes more than MAX_ROWS rows) and which may have no native kernel at all.
        probe = torch.empty(min(rows, MAX_ROWS), self.model.config.hidden_size)
        layers = (_Layer * len(self.model.layers))()
        keep: list[torch.Tensor] = []
        for entry, layer, cache in zip(layers, self.model.layers, meta.kv_caches):
            attention, mlp = layer.self_attn, layer.mlp
            for field, module in zip(("q", "k", "v", "o"), (getattr(attention, n) for n in ATTENTION_LINEARS)):
                if not _fill_linear(getattr(entry, field), module, probe, keep, self.bf16):
                    return None
            for field, module in zip(("gate", "up", "down"), (getattr(mlp, n) for n in MLP_LINEARS)):
                if not _fill_linear(getattr(entry, field), module, probe, keep, self.bf16):
                    return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm)
            if any(norm is not None and not _fp32_vector(norm.weight) for norm in norms):
                return None
            entry.input_norm, entry.post_attention_norm = norms[0].weight.data_ptr(), norms[1].weight.data_ptr()
            entry.q_norm = norms[2].weight.data_ptr() if norms[2] is not None else None
            entry.k_norm = norms[3].weight.data_ptr() if norms[3] is not None else None
            entry.kv_cache = cache.data_ptr()
        if not _fp32_vector(self.model.norm.weight):
            return None
        linears = [getattr(entry, field) for entry in layers for field in ("q", "k", "v", "o", "gate", "up", "down")]
        all_bf16 = all(linear.group == BF16_WEIGHT for linear in linears)
        table = _Table(layers, BF16_MAX_ROWS if all_bf16 else MAX_ROWS, fingerprint, keep)
        if fingerprint[-1] != -1:  # the head and the embedding are not hooked (_fingerprint_ends)
            self._fill_ends(table, probe)
        return table

    def _fill_ends(self, table: _Table, probe: torch.Tensor) -> None:
        """table.head and table.embedding where the LM head is a layer `_fill_linear` takes (the module path runs
        the same kernel on it) and the embedding a plain fp32 lookup table."""
        model = self.model
        embedding = model.embed_tokens
        weight = embedding.weight
        plain = type(embedding) is nn.Embedding and embedding.max_norm is None and type(weight) in _PLAIN
        if not (plain and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()):
            return
        head = _Linear()
        if _fill_linear(head, model.lm_head, probe, table.keep, self.bf16) and head.in_features == weight.shape[1]:
            table.head, table.embedding = head, weight


def _fill_linear(
    entry: _Linear, module: nn.Module, probe: torch.Tensor, keep: list[torch.Tensor], bf16: Bf16Weights | None
) -> bool:
    """Point `entry` at an fp32 nn.Linear's weight (or its bf16 copy, in bf16 compute) or an int8 layer's codes and
    scales (and which int8 kernel the layer runs); False for any other."""
    if type(module) not in (nn.Linear, QuantizedLinear):
        return False
    bias = module.bias
    if bias is not None and not _fp32_vector(bias):
        return False
    entry.bias = bias.data_ptr() if bias is not None else None
    if type(module) is nn.Linear:
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            return False
        entry.weight, entry.scales, entry.group, entry.quantize_input = weight.data_ptr(), None, 0, 0
        if bf16 is not None:
            copy = bf16.copy_of(weight)
            keep.append(copy)
            entry.weight, entry.group = copy.data_ptr(), BF16_WEIGHT
        entry.out_features, entry.in_features = weight.shape
        return True
    operands = native_int8_operands(module, _probe(probe, module))
    if operands is None:
        return False
    keep.append(operands.scales)
    entry.weight, entry.scales, entry.group = operands.codes.data_ptr(), operands.scales.data_ptr(), operands.group
    entry.quantize_input = int(operands.quantize_input)
    entry.out_features, entry.in_features = operands.codes.shape
    return True


def _probe(probe: torch.Tensor, module: QuantizedLinear) -> torch.Tensor:
    """An input of the step's rows and this layer's in_features (the MLP's down projection takes more)."""
    if probe.shape[1] == module.in_features:
        return probe
    return torch.empty(probe.shape[0], module.in_features)


def one_query_per_token(meta) -> NativeDecodePlan:  # noqa: ANN001 (PagedAttentionMetadata)
    """The decode kernel's plan for a step whose sequences bring several new tokens (a speculative check: the last
    token and the drafts; a short prompt): every token a lone one-token query over its sequence's blocks, seeing its
    context up to itself. Token j of a sequence with L new tokens and context C (after the step's writes) sees
    C - L + 1 + j tokens. The step's K/V are all written before any layer attends, as in the module path.

    A token's result is then what a plain decode step computes at its position (bit for bit at batch 1, where a
    decode step's sequence is a lone group too), where the module path would run these rows through masked SDPA."""
    query_lens, context_lens = meta.query_lens, meta.context_lens  # (S,) each
    S, N = query_lens.numel(), int(query_lens.sum())
    seq = torch.repeat_interleave(torch.arange(S), query_lens)  # (N,) the sequence of each new token
    first = torch.cumsum(query_lens, 0) - query_lens  # (S,) row of each sequence's first new token
    j = torch.arange(N) - first[seq]  # (N,) its place among its sequence's new tokens
    return NativeDecodePlan(
        tables=meta.block_tables.index_select(0, seq).contiguous(),  # (N, W)
        context_lens=(context_lens[seq] - query_lens[seq] + 1 + j).contiguous(),  # (N,)
        rows=torch.arange(N),
        group_starts=torch.arange(N + 1),  # N groups of one that share nothing
        group_shared=torch.zeros(N, dtype=torch.long),
        max_members=1,
    )


def _watch_tensors(watch: _Watch, tensors: dict[str, torch.Tensor | None], versioned: bool) -> None:
    """Record a module's parameters or buffers: each in its place, with its storage (and version, `versioned`)."""
    for name, t in tensors.items():
        watch.places.append((tensors, name, t))
        if t is not None:
            watch.tensors.append((t, t.data_ptr(), t._version if versioned else -1))


def _bf16_copyable(weight: torch.Tensor) -> bool:
    return type(weight) in _PLAIN and weight.dtype == torch.float32 and weight.dim() == 2


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def _fp32_vector(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()

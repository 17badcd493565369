"""Peak training memory per device, from the architecture and the training setup, with no weights loaded.

Every term is a closed formula over the shapes (docs/estimate.md writes them out). The activation
term counts the tensors that autograd actually keeps for *our* model (posttrain.models: pre-norm
RMSNorm computed in fp32, SDPA attention, SwiGLU) and *our* trainers' loss heads (trainer_rules.py, one
rule per trainer), so it is a count, not a rule of thumb; tests/test_estimate.py checks it against the
saved tensors of a tiny model, tensor by tensor.

Notation: d hidden, f intermediate, H / Hkv heads / KV heads, D head dim, V vocab, b bytes of the
compute dtype, r LoRA rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.errors import PosttrainError
from posttrain.estimate.trainer_rules import TRAINERS, logit_tokens, loss_head, rules, trunk_tokens
from posttrain.models.config import ModelConfig

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEARS = ATTENTION_LINEARS + MLP_LINEARS

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "sgd": 1}  # AdamW: exp_avg, exp_avg_sq; SGD: momentum buffer
KV_BLOCK_TOKENS = 16  # the engine allocates its KV pool in blocks of this many tokens (EngineConfig.block_size)

Method = Literal["full", "lora", "qlora"]
Trainer = Literal["sft", "dpo", "rm", "grpo", "ppo"]  # the keys of trainer_rules.TRAINERS


def dtype_bytes(dtype: str) -> int:
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise PosttrainError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


# ----------------------------------------------------------------------------- the model's shapes


@dataclass(frozen=True)
class Architecture:
    """The shapes that memory depends on. `params` overrides the count implied by the shapes."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    params: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PosttrainError(f"{name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise PosttrainError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.params is not None and self.params < 1:
            raise PosttrainError(f"params must be positive, got {self.params}")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> Architecture:
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings,
                   cfg.attention_bias, cfg.qk_norm)

    @classmethod
    def from_model(cls, name_or_path: str) -> Architecture:
        """The architecture of a model (HF directory, GGUF file or known name) from its config alone:
        no weights are read (a GGUF is converted into the cache on first use, as every command does)."""
        from posttrain.models.checkpoint_io import read_hf_config
        from posttrain.models.hub import resolve_model_path

        return cls.from_model_config(read_hf_config(resolve_model_path(name_or_path)))

    @classmethod
    def from_params(cls, params: int, layers: int, hidden: int, heads: int | None = None,
                    kv_heads: int | None = None, vocab: int | None = None, intermediate: int | None = None,
                    head_dim: int | None = None, tied_embeddings: bool = False) -> Architecture:
        """A hypothetical model of `params` parameters. Unset shapes get the common defaults (128-wide
        heads, MHA, a 32k vocabulary); an unset intermediate size is solved from `params`."""
        heads = heads or max(hidden // 128, 1)
        head_dim = head_dim or hidden // heads
        kv_heads = kv_heads or heads
        vocab = vocab or 32000
        if intermediate is None:
            attn = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
            embed = vocab * hidden * (1 if tied_embeddings else 2)
            per_layer = (params - embed - hidden) / layers - attn - 2 * hidden
            intermediate = int(per_layer // (3 * hidden))
            if intermediate < 1:
                raise PosttrainError(f"--params {params} is too small for {layers} layers of width {hidden} and a "
                                     f"{vocab}-token vocabulary (the embeddings alone are {embed} parameters)")
        return cls(layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, tied_embeddings, params=params)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each decoder linear, by module name."""
        d, f, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}

    @property
    def linear_params(self) -> int:
        """Weights of the decoder linears, all layers (what QLoRA quantizes and LoRA can target)."""
        return self.layers * sum(i * o for i, o in self.linear_shapes().values())

    @property
    def shape_params(self) -> int:
        """The count implied by the shapes (the formula of ModelConfig.num_parameters)."""
        d, hd = self.hidden, self.head_dim
        layer = sum(i * o for i, o in self.linear_shapes().values()) + 2 * d
        if self.attention_bias:
            layer += (self.heads + 2 * self.kv_heads) * hd
        if self.qk_norm:
            layer += 2 * hd
        return self.layers * layer + self.vocab * d * (1 if self.tied_embeddings else 2) + d

    @property
    def num_parameters(self) -> int:
        return self.params if self.params is not None else self.shape_params

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


# ----------------------------------------------------------------------------- the training setup


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained, per device. Sizes are per device: `batch` sequences per micro-batch."""

    method: Method = "full"
    optimizer: str = "adamw"
    dtype: str = "float32"  # weights and compute
    mixed: bool = False  # fp32 master weights and fp32 optimizer states over half-precision weights
    zero: int = 0  # ZeRO / FSDP stage: 1 shards optimizer states, 2 also gradients, 3 also weights
    gpus: int = 1
    batch: int = 1  # per micro-batch: SFT sequences, DPO / RM pairs, RL samples (TrainerRules.batch)
    seq_len: int = 512  # tokens per sequence, prompt + completion
    prompt_len: int = 0  # of seq_len: tokens with no loss (SFT completion-only loss; the DPO and RL prompt)
    grad_accum: int = 1  # micro-batches per optimizer step
    trainer: Trainer = "sft"
    group_size: int = 8  # RL: samples per prompt, packed into one row with the prompt once
    rollout_seqs: int | None = None  # RL: sequences the KV pool holds at once; None: batch
    kv_tokens: int | None = None  # RL: KV pool size in tokens; None: rollout_seqs x seq_len, whole blocks
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEARS
    quant_bits: int = 4  # QLoRA base
    quant_group: int = 64  # QLoRA: weights per fp16 scale
    reference: bool = False  # a live frozen reference (RL KL, DPO reference=live); with LoRA the base serves
    checkpointing: bool = False  # which activation figure goes into total_bytes
    overhead_bytes: int = 0  # the runtime's own memory (interpreter, libraries, CUDA context)

    def __post_init__(self) -> None:
        if self.method not in ("full", "lora", "qlora"):
            raise PosttrainError(f"method {self.method!r} is not one of full, lora, qlora")
        if self.optimizer not in OPTIMIZER_STATES:
            raise PosttrainError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}")
        if self.trainer not in TRAINERS:
            raise PosttrainError(f"trainer {self.trainer!r} is not one of {', '.join(TRAINERS)}")
        if self.reference and self.trainer == "rm":
            raise PosttrainError("reference: the rm trainer has no reference model (it trains a score head on pairs)")
        dtype_bytes(self.dtype)
        if self.zero not in (0, 1, 2, 3):
            raise PosttrainError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        for name in ("gpus", "batch", "seq_len", "grad_accum", "group_size", "lora_r", "quant_group"):
            if getattr(self, name) < 1:
                raise PosttrainError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.prompt_len < self.seq_len:
            raise PosttrainError(f"prompt-len must be in [0, seq-len={self.seq_len}), got {self.prompt_len}")
        if self.quant_bits not in (4, 8):
            raise PosttrainError(f"quant bits must be 4 or 8, got {self.quant_bits}")
        for name in ("rollout_seqs", "kv_tokens", "overhead_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PosttrainError(f"{name.replace('_', '-')} must be >= 0, got {value}")
        unknown = [t for t in self.lora_targets if t not in ALL_LINEARS]
        if unknown or not self.lora_targets:
            raise PosttrainError(f"lora targets {list(self.lora_targets)}: choose from {', '.join(ALL_LINEARS)}")

    @property
    def element_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def trainable_bytes(self) -> int:
        """Element size of the trainable parameters: the model dtype, except QLoRA adapters, which are
        fp32 (LoRALinear gives adapters the base weight's dtype, and a quantized base has no float one)."""
        return 4 if self.method == "qlora" else self.element_bytes

    @property
    def completion_len(self) -> int:
        return self.seq_len - self.prompt_len


# ----------------------------------------------------------------------------- the terms


def adapter_params(arch: Architecture, setup: TrainingSetup) -> int:
    """LoRA parameters: A (r, in) + B (out, r) per targeted linear per layer."""
    shapes = arch.linear_shapes()
    return arch.layers * sum(setup.lora_r * (shapes[t][0] + shapes[t][1]) for t in setup.lora_targets)


def scalar_head(arch: Architecture, setup: TrainingSetup) -> tuple[int, int]:
    """(parameters, bytes each) of the head trained in full beside the trunk: RM's score head, PPO's value
    head; (0, 0) for the other trainers."""
    head = rules(setup).scalar_head
    return (0, 0) if head is None else (head.params(arch.hidden), head.element_bytes(setup))


def trunk_trainable_params(arch: Architecture, setup: TrainingSetup) -> int:
    """Trunk parameters that get a gradient: all of them (full) or the adapters. RM never runs the LM head:
    untied, it gets no gradient, and AdamW keeps no state for a parameter without one."""
    if setup.method != "full":
        return adapter_params(arch, setup)
    unused_head = 0 if rules(setup).lm_head or arch.tied_embeddings else arch.vocab * arch.hidden
    return arch.num_parameters - unused_head


def trainable_params(arch: Architecture, setup: TrainingSetup) -> int:
    return trunk_trainable_params(arch, setup) + scalar_head(arch, setup)[0]


def weights_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """The trunk's weights (see `trunk_weights_bytes`) and a scalar head's."""
    head, head_bytes = scalar_head(arch, setup)
    return trunk_weights_bytes(arch, setup) + head * head_bytes


def trunk_weights_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """Full / LoRA: every parameter in the model dtype (+ the adapters). QLoRA: the decoder linears at
    quant_bits / 8 bytes a weight plus one fp16 scale per quant_group weights; embeddings, norms and an
    untied LM head stay in the model dtype; adapters in fp32."""
    b = setup.element_bytes
    if setup.method == "full":
        return arch.num_parameters * b
    adapters = adapter_params(arch, setup) * setup.trainable_bytes
    if setup.method == "lora":
        return arch.num_parameters * b + adapters
    linear = arch.linear_params
    quantized = linear * setup.quant_bits // 8 + math.ceil(linear / setup.quant_group) * 2
    return quantized + (arch.num_parameters - linear) * b + adapters


def grads_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """One gradient per trainable parameter, in its dtype (frozen weights have none)."""
    head, head_bytes = scalar_head(arch, setup)
    return trunk_trainable_params(arch, setup) * setup.trainable_bytes + head * head_bytes


def _states_bytes(params: int, element_bytes: int, setup: TrainingSetup) -> int:
    """States per parameter (AdamW 2, SGD-momentum 1) in the parameter's dtype, as torch's optimizers keep
    them (zeros_like(param)). Mixed precision: fp32 states plus an fp32 master copy of a half parameter."""
    states = OPTIMIZER_STATES[setup.optimizer]
    if setup.mixed and element_bytes != 4:
        return params * (states * 4 + 4)
    return params * states * element_bytes


def optimizer_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """The trunk's trainable parameters' states and a scalar head's (its own dtype: RM's is fp32)."""
    head, head_bytes = scalar_head(arch, setup)
    trunk = _states_bytes(trunk_trainable_params(arch, setup), setup.trainable_bytes, setup)
    return trunk + _states_bytes(head, head_bytes, setup)


def _norm_bytes(width: int, b: int, *, weight_trains: bool, output_saved: bool, input_grad: bool = True) -> int:
    """What an RMSNorm of one `width` vector keeps per token. Autograd keeps only what a needed gradient
    uses: the fp32 input (x.float(); x itself in fp32) and the fp32 rsqrt when its input needs a gradient,
    the normalised vector (cast back to the dtype) when its weight trains, and its output when the next
    op keeps that (a trained or adapted linear does; RoPE after the q/k norms does not)."""
    kept = 4 * width + 4 if input_grad else 0
    return kept + (b * width if weight_trains else 0) + (b * width if output_saved else 0)


def layer_bytes_per_token(arch: Architecture, setup: TrainingSetup, first: bool = False) -> int:
    """Bytes one decoder layer keeps for backward per token (no mask; see `mask_bytes_per_layer`).

    `first`: layer 0 under LoRA, whose input (a frozen embedding's output) needs no gradient."""
    b, d, f = setup.element_bytes, arch.hidden, arch.intermediate
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    full = setup.method == "full"
    targets = set(ALL_LINEARS if full else setup.lora_targets)  # linears whose input is kept for a weight grad
    total = _norm_bytes(d, b, weight_trains=full, output_saved=bool(targets & {"q_proj", "k_proj", "v_proj"}),
                        input_grad=full or not first)
    total += _norm_bytes(d, b, weight_trains=full, output_saved=bool(targets & {"gate_proj", "up_proj"}))
    if arch.qk_norm:  # Qwen3: per-head norms of q and k (one rsqrt per head), outputs go to RoPE only
        total += _norm_bytes(q, b, weight_trains=full, output_saved=False)
        total += _norm_bytes(kv, b, weight_trains=full, output_saved=False)
        total += 4 * (arch.heads + arch.kv_heads - 2)
    if b != 4:  # RoPE casts the fp32 cos/sin to the dtype for q and for k: four new (D,) vectors per layer
        total += 4 * arch.head_dim * b
    # SDPA keeps q (rotated), k, v, its output (also o_proj's input) and an fp32 logsumexp per head.
    total += b * (2 * q + 2 * kv) + 4 * arch.heads
    # SwiGLU: gate out (silu's input), silu out and up out (the product's), the product (down's input).
    total += b * f * (4 if "down_proj" in targets else 3)
    if not full:
        a = setup.trainable_bytes
        shapes = arch.linear_shapes()
        for target in setup.lora_targets:
            total += a * setup.lora_r  # B's input: A(x) * scaling
            if a != b:  # the adapter casts x to its own dtype first: a kept copy of the input per adapter
                total += a * shapes[target][0]
    return total


def mask_bytes_per_layer(arch: Architecture, setup: TrainingSetup) -> int:
    """An explicit attention mask (GRPO's and PPO's packed groups; right-padded rows are plain causal) is
    converted by SDPA to the dtype in every layer and kept for backward: rows x width^2 x b."""
    if rules(setup).layout != "groups":
        return 0
    rows, width = trunk_tokens(setup)
    return rows * width * width * setup.element_bytes


def global_bytes_per_token(arch: Architecture, setup: TrainingSetup) -> int:
    """Outside the layers: the token ids (the embedding's backward, when it trains), RoPE's fp32 cos/sin
    (computed once, shared by the layers; kept only in fp32: in half precision the rotations multiply by
    per-layer casts, counted in `layer_bytes_per_token`, and the fp32 originals are not kept) and the final
    norm (its output is not kept: the loss head keeps what it gathers, counted in `logits_bytes`)."""
    full = setup.method == "full"
    ids = 8 if full else 0
    rope = 2 * arch.head_dim * 4 if setup.element_bytes == 4 else 0
    final_norm = _norm_bytes(arch.hidden, setup.element_bytes, weight_trains=full, output_saved=False)
    return ids + rope + final_norm


def activations_bytes(arch: Architecture, setup: TrainingSetup, checkpointing: bool = False) -> int:
    """What the forward of one micro-batch keeps for backward, the loss head excluded.

    With activation checkpointing each layer keeps only its input (b x d per token) and one layer's
    activations exist again while it is recomputed during backward."""
    rows, width = trunk_tokens(setup)
    tokens = rows * width
    mask = mask_bytes_per_layer(arch, setup)
    per_layer = tokens * layer_bytes_per_token(arch, setup) + mask
    first = tokens * layer_bytes_per_token(arch, setup, first=True) + mask
    outside = tokens * global_bytes_per_token(arch, setup)
    if checkpointing:
        return arch.layers * tokens * setup.element_bytes * arch.hidden + per_layer + outside
    return first + (arch.layers - 1) * per_layer + outside


def logits_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """The loss head's memory at its peak, on top of the activations: what it keeps for backward and what
    it holds on top (the logits' gradient, chunk scratch); one rule per trainer in trainer_rules.py."""
    return loss_head(arch, setup).peak


def kv_cache_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """The rollout engine's KV pool: 2 (K and V) x layers x kv_heads x head_dim x bytes x tokens.
    Tokens: kv_tokens, else rollout_seqs (default: batch) sequences of seq_len in whole 16-token blocks.
    Only grpo and ppo have a rollout; the others none, unless kv_tokens asks for it."""
    tokens = setup.kv_tokens
    if tokens is None:
        if not rules(setup).rollout:
            return 0
        seqs = setup.rollout_seqs if setup.rollout_seqs is not None else setup.batch
        tokens = seqs * math.ceil(setup.seq_len / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return arch.kv_bytes_per_token(setup.element_bytes) * tokens


def reference_bytes(arch: Architecture, setup: TrainingSetup) -> int:
    """A frozen copy of the trunk's weights for a KL / DPO reference (no scalar head: PPO's reference is
    the initial policy). With LoRA the reference is the base with the adapters switched off: no copy.
    The trainers take it with copy.deepcopy before any DDP / FSDP2 wrapping, so every device holds all
    of it: ZeRO-3 does not shard it."""
    if not setup.reference or setup.method != "full":
        return 0
    return arch.num_parameters * setup.element_bytes


# ----------------------------------------------------------------------------- the peak


@dataclass
class MemoryEstimate:
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    activations_checkpointed_bytes: int
    logits_bytes: int
    kv_cache_bytes: int
    reference_bytes: int
    runtime_overhead_bytes: int
    total_bytes: int  # the peak as configured (setup.checkpointing picks which of the two below)
    total_checkpointed_bytes: int
    total_uncheckpointed_bytes: int
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "details"}
        out.update(self.details)
        return out


def _shard(value: int, setup: TrainingSetup, from_stage: int) -> int:
    return math.ceil(value / setup.gpus) if setup.zero >= from_stage else value


def peak_bytes(static: int, grads: int, dynamic: int, grad_accum: int) -> int:
    """Static memory plus the larger of what backward holds.

    With one micro-batch per step and gradients freed after each step (set_to_none), the gradient
    buffers fill while the activations drain during backward, so the peak is max(grads, activations +
    loss head). With accumulation, the gradients of the earlier micro-batches are there for the whole
    backward of the next: the sum."""
    return static + (grads + dynamic if grad_accum > 1 else max(grads, dynamic))


def estimate_memory(arch: Architecture, setup: TrainingSetup) -> MemoryEstimate:
    """Per-device peak memory of one training step (see `peak_bytes` for how the terms combine)."""
    weights = _shard(weights_bytes(arch, setup), setup, 3)
    grads = _shard(grads_bytes(arch, setup), setup, 2)
    optim = _shard(optimizer_bytes(arch, setup), setup, 1)
    acts = activations_bytes(arch, setup)
    acts_ckpt = activations_bytes(arch, setup, checkpointing=True)
    head = logits_bytes(arch, setup)
    kv = kv_cache_bytes(arch, setup)
    ref = reference_bytes(arch, setup)  # whole on every device (see reference_bytes)
    static = weights + optim + kv + ref + setup.overhead_bytes
    plain = peak_bytes(static, grads, acts + head, setup.grad_accum)
    checkpointed = peak_bytes(static, grads, acts_ckpt + head, setup.grad_accum)
    rows, width = trunk_tokens(setup)
    details = {
        "parameters": arch.num_parameters,
        "trainable_parameters": trainable_params(arch, setup),
        "head_parameters": scalar_head(arch, setup)[0],
        "trunk_tokens": rows * width,
        "logit_tokens": logit_tokens(setup),
        "activation_bytes_per_token_per_layer": layer_bytes_per_token(arch, setup),
        "peak_rule": "sum" if setup.grad_accum > 1 else "max(grads, activations + logits)",
    }
    return MemoryEstimate(weights, grads, optim, acts, acts_ckpt, head, kv, ref, setup.overhead_bytes,
                          checkpointed if setup.checkpointing else plain, checkpointed, plain, details)

"""Peak training memory per device, from the architecture and the training setup, with no weights loaded.

Every term is a closed formula over the shapes (docs/estimate.md writes them out), read from an
`Architecture` and a `TrainingSetup` (inputs.py). The activation term counts the tensors that autograd
actually keeps for *our* model (posttrain.models: pre-norm RMSNorm computed in fp32, SDPA attention,
SwiGLU) and *our* trainers' loss heads (trainer_rules.py, one rule per trainer), so it is a count, not a
rule of thumb; tests/estimate/test_estimate.py checks it against the saved tensors of a tiny model, tensor by tensor.

Notation: d hidden, f intermediate, H / Hkv heads / KV heads, D head dim, V vocab, b bytes of the
compute dtype, r LoRA rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from posttrain.estimate.inputs import ALL_LINEARS, OPTIMIZER_STATES, Architecture, TrainingSetup
from posttrain.estimate.trainer_rules import logit_tokens, loss_head, packed_groups, rules, trunk_tokens

KV_BLOCK_TOKENS = 16  # the engine allocates its KV pool in blocks of this many tokens (EngineConfig.block_size)


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
    total = _norm_bytes(
        d,
        b,
        weight_trains=full,
        output_saved=bool(targets & {"q_proj", "k_proj", "v_proj"}),
        input_grad=full or not first,
    )
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
    """An explicit attention mask (packed pairs and groups: dpo, grpo, ppo; right-padded rows are plain causal) is
    converted by SDPA to the dtype in every layer and kept for backward: rows x width^2 x b."""
    if packed_groups(setup) is None:
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
    return MemoryEstimate(
        weights,
        grads,
        optim,
        acts,
        acts_ckpt,
        head,
        kv,
        ref,
        setup.overhead_bytes,
        checkpointed if setup.checkpointing else plain,
        checkpointed,
        plain,
        details,
    )

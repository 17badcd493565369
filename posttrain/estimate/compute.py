"""Time per training step: FLOPs counted from the shapes, divided by a stated throughput.

The throughput is an input, not a prediction: `--tflops` (achieved, not peak), by default the device
kind's dense bf16 peak times an assumed utilisation (MFU) of 40%. Decoding during RL rollouts is bound by
memory bandwidth rather than FLOPs at small batch, so a rollout takes the longer of its FLOP time and
one read of the weights per generated token (per decode step of the whole batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import PosttrainError
from posttrain.estimate.inputs import Architecture, TrainingSetup
from posttrain.estimate.memory import adapter_params
from posttrain.estimate.trainer_rules import logit_tokens, packed_groups, rules, sequences, trunk_tokens

DEFAULT_MFU = 0.4
MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class DeviceKind:
    name: str
    peak_tflops: float  # dense bf16 (CPU: what we measured in fp32, already "achieved")
    bandwidth_gbs: float  # memory bandwidth, GB/s
    memory_bytes: int | None  # per device; None: the host's RAM, unknown here
    overhead_bytes: int  # the runtime's own memory, outside the tensors we count
    mfu: float = DEFAULT_MFU  # the fraction of peak taken as achieved

    @property
    def tflops(self) -> float:
        return self.peak_tflops * self.mfu


DEVICES: dict[str, DeviceKind] = {
    # CPU: ~0.06 TFLOPS measured for the SFT step of the default model in fp32 on one AVX2 core of this
    # machine (benchmarks/estimate.py prints the measured step time next to the estimate). Overhead: peak RSS
    # of `import torch` + posttrain's trainers + the default tokenizer, measured by benchmarks/estimate.py
    # (270-280 MiB with torch 2.13, CPU build, Linux x86-64).
    "cpu": DeviceKind("cpu", 0.06, 20.0, None, 280 * MIB, mfu=1.0),
    # GPUs: vendor dense bf16 peaks and HBM bandwidths; overhead ~0.5 GiB of CUDA context and library
    # workspaces (not measured here: typical of recent CUDA / PyTorch, varies with version and kernels).
    "a100": DeviceKind("a100", 312.0, 2039.0, 80 * GIB, 512 * MIB),
    "h100": DeviceKind("h100", 989.0, 3350.0, 80 * GIB, 512 * MIB),
    "h200": DeviceKind("h200", 989.0, 4800.0, 141 * GIB, 512 * MIB),
    "l4": DeviceKind("l4", 121.0, 300.0, 24 * GIB, 512 * MIB),
}


def device_kind(name: str) -> DeviceKind:
    if name not in DEVICES:
        raise PosttrainError(f"device {name!r} is not one of {', '.join(DEVICES)}")
    return DEVICES[name]


def _attention_pairs(setup: TrainingSetup) -> int:
    """(query, key) pairs attended in one micro-batch: causal over each right-padded row (sft; rm without a
    prompt), or in a packed pair's or group's row (dpo, grpo, ppo; rm with a prompt) every completion token
    sees the prompt and its own earlier tokens."""
    packed = packed_groups(setup)
    if packed is None:
        rows, width = trunk_tokens(setup)
        return rows * width * (width + 1) // 2
    rows, completions, c = packed  # c: a completion's input tokens
    p = setup.prompt_len
    per_completion = c * p + c * (c + 1) // 2
    return rows * (p * (p + 1) // 2 + completions * per_completion)


def lm_head_flops(arch: Architecture, setup: TrainingSetup) -> int:
    """The LM head on the target positions only: 2 V d each."""
    return 2 * arch.vocab * arch.hidden * logit_tokens(setup)


def scalar_head_flops(arch: Architecture, setup: TrainingSetup) -> int:
    """A Linear(d, 1) head, 2 d per state it reads: RM's score head each row's last state, PPO's value head
    every target's predicting state."""
    head = rules(setup).scalar_head
    if head is None:
        return 0
    return 2 * arch.hidden * (logit_tokens(setup) if head.per_target else sequences(setup))


def forward_flops(arch: Architecture, setup: TrainingSetup) -> int:
    """One forward of a micro-batch: 2 FLOPs per weight per token through the decoder linears, the heads,
    and QK^T + AV (4 x heads x head_dim per attended pair)."""
    rows, width = trunk_tokens(setup)
    linear = 2 * arch.linear_params * rows * width
    attention = 4 * arch.layers * arch.heads * arch.head_dim * _attention_pairs(setup)
    return linear + lm_head_flops(arch, setup) + scalar_head_flops(arch, setup) + attention


def scoring_flops(arch: Architecture, setup: TrainingSetup) -> int:
    """No-grad forwards of a micro-batch besides the trained one: a live reference's (--reference with dpo,
    grpo, ppo; it has no value head) and PPO's old log-probs and values (GAE needs V at the rollout's
    weights, so ppo always runs it)."""
    trainer = rules(setup)
    fwd = forward_flops(arch, setup)
    reference = fwd - scalar_head_flops(arch, setup) if setup.reference and trainer.reference_pass else 0
    return reference + trainer.scoring_passes * fwd


def train_flops(arch: Architecture, setup: TrainingSetup) -> int:
    """One optimizer step: forward + backward for every micro-batch, and its no-grad scoring passes.

    Backward costs one forward for the activation gradients, and one more for the weight gradients when
    the weights train (full: 3x forward in all); LoRA adds only its adapters' weight gradients (6 FLOPs
    per adapter weight per token). Activation checkpointing recomputes the decoder's forward once more."""
    rows, width = trunk_tokens(setup)
    fwd = forward_flops(arch, setup)
    if setup.method == "full":
        step = 3 * fwd
    else:
        step = 2 * fwd + 6 * adapter_params(arch, setup) * rows * width
    if setup.checkpointing:
        step += fwd - lm_head_flops(arch, setup) - scalar_head_flops(arch, setup)  # heads: not recomputed
    return (step + scoring_flops(arch, setup)) * setup.grad_accum


def rollout_flops(arch: Architecture, setup: TrainingSetup) -> int:
    """GRPO / PPO: generating the micro-batches' completions. Each prompt is prefilled once per group
    (prefix caching), every generated token runs the decoder and the LM head."""
    if not rules(setup).rollout:
        return 0
    groups = -(-setup.batch // setup.group_size)
    tokens = groups * setup.prompt_len + setup.batch * setup.completion_len
    return 2 * (arch.linear_params + arch.vocab * arch.hidden) * tokens * setup.grad_accum


@dataclass
class TimeEstimate:
    train_flops: int
    rollout_flops: int
    tflops: float
    bandwidth_gbs: float
    train_seconds: float
    rollout_seconds: float
    step_seconds: float

    def as_dict(self) -> dict[str, float | int]:
        return dict(vars(self))


def estimate_time(
    arch: Architecture, setup: TrainingSetup, weights_bytes: int, tflops: float, bandwidth_gbs: float
) -> TimeEstimate:
    """Seconds per optimizer step at `tflops` achieved; rollouts bounded below by reading `weights_bytes`
    once per decode step (completion_len steps per micro-batch)."""
    if not tflops > 0 or not bandwidth_gbs > 0:
        raise PosttrainError(f"throughput must be positive (tflops={tflops}, bandwidth={bandwidth_gbs} GB/s)")
    train = train_flops(arch, setup)
    rollout = rollout_flops(arch, setup)
    train_s = train / (tflops * 1e12)
    rollout_s = 0.0
    if rollout:
        decode_steps = setup.completion_len * setup.grad_accum
        rollout_s = max(rollout / (tflops * 1e12), decode_steps * weights_bytes / (bandwidth_gbs * 1e9))
    return TimeEstimate(train, rollout, tflops, bandwidth_gbs, train_s, rollout_s, train_s + rollout_s)

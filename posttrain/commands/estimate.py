"""`posttrain estimate`: memory per device and time per step of a training setup, from the shapes alone.

    posttrain estimate                                        # the default model, full fine-tuning, fp32 on CPU
    posttrain estimate --model runs/m --method lora --device h100 --batch 8 --seq-len 2048 --json
    posttrain estimate --params 7B --layers 32 --hidden 4096 --kv-heads 8 --vocab 128256 --zero 3 --gpus 8
    posttrain estimate --trainer dpo --reference --batch 4 --seq-len 1024 --prompt-len 256 --json

The formulas are in docs/estimate.md.
"""

from __future__ import annotations

import argparse
import json
import re

from posttrain.commands.common import add_json_argument
from posttrain.errors import PosttrainError
from posttrain.estimate import ALL_LINEARS, DEVICES, Architecture, TrainingSetup, estimate_memory, estimate_time
from posttrain.estimate.compute import device_kind
from posttrain.estimate.memory import weights_bytes
from posttrain.estimate.trainer_rules import TRAINERS
from posttrain.models.hub import DEFAULT_MODEL

_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(b|kib|mib|gib|tib|kb|mb|gb|tb)?\s*$", re.IGNORECASE)
_COUNT_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_SIZE_SCALE = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
ARCH_ARGS = ("layers", "hidden", "heads", "kv_heads", "vocab", "intermediate", "head_dim")


def parse_count(text: str) -> int:
    """`135M`, `7B`, `1.5e9`, `70000000` -> an integer count."""
    match = _COUNT.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 135M, 7B, 1.5e9)")
    return int(float(match.group(1)) * _COUNT_SCALE[match.group(2).lower()])


def parse_size(text: str) -> int:
    """`300MiB`, `1.5GiB`, `0`, `512` (bytes) -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 300MiB, 1.5GiB)")
    return int(float(match.group(1)) * _SIZE_SCALE[(match.group(2) or "b").lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of --model or --params)")
    model.add_argument(
        "--model",
        default=None,
        help=f"HF directory, .gguf file or known name; only its config is read (default: {DEFAULT_MODEL})",
    )
    model.add_argument(
        "--params",
        type=parse_count,
        default=None,
        help="a hypothetical model of this many parameters (135M, 7B); needs --layers and --hidden",
    )
    for name, text in (
        ("layers", "decoder layers"),
        ("hidden", "hidden size"),
        ("heads", "attention heads (default hidden / 128)"),
        ("kv-heads", "KV heads (default: heads)"),
        ("vocab", "vocabulary size (default 32000)"),
        ("intermediate", "MLP width (default: solved from --params)"),
        ("head-dim", "head dimension (default hidden / heads)"),
    ):
        model.add_argument(f"--{name}", type=int, default=None, help=text)
    model.add_argument("--tied", action="store_true", help="--params model: tied input / output embeddings")

    train = parser.add_argument_group("training")
    train.add_argument("--method", choices=("full", "lora", "qlora"), default="full")
    train.add_argument("--lora-r", type=int, default=16)
    train.add_argument(
        "--lora-targets",
        default="all-linear",
        help=f"comma-separated of {', '.join(ALL_LINEARS)}, or all-linear (default)",
    )
    train.add_argument("--quant-bits", type=int, choices=(4, 8), default=4, help="QLoRA base weights (default 4)")
    train.add_argument("--quant-group", type=int, default=64, help="QLoRA: weights per fp16 scale (default 64)")
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    train.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on cpu, bf16 on GPUs)"
    )
    train.add_argument(
        "--mixed", action="store_true", help="fp32 master weights and fp32 optimizer states over half-precision weights"
    )
    train.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=0,
        help="ZeRO / FSDP stage: 1 shards optimizer states, 2 also gradients, 3 also weights",
    )
    train.add_argument("--gpus", type=int, default=1, help="devices the ZeRO stage shards over")
    train.add_argument(
        "--trainer",
        choices=tuple(TRAINERS),
        default="sft",
        help="the rows through the model, the loss head, a score / value head (rm, ppo) and a "
        "rollout KV cache (grpo, ppo) (default sft)",
    )
    by_meaning: dict[str, list[str]] = {}  # dpo and rm both count pairs, grpo and ppo samples: say it once
    for name, trainer in TRAINERS.items():
        by_meaning.setdefault(trainer.batch, []).append(name)
    batch_meaning = "; ".join(f"{', '.join(names)}: {meaning}" for meaning, names in by_meaning.items())
    train.add_argument("--batch", type=int, default=1, help=f"per micro-batch per device (default 1): {batch_meaning}")
    train.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sequence, prompt + completion (default 512)"
    )
    train.add_argument("--prompt-len", type=int, default=0, help="of --seq-len, tokens without loss (default 0)")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    train.add_argument("--group-size", type=int, default=8, help="grpo / ppo: samples per prompt (default 8)")
    train.add_argument(
        "--rollout-seqs", type=int, default=None, help="grpo / ppo: sequences in the KV pool (default --batch)"
    )
    train.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens (overrides --rollout-seqs)")
    train.add_argument(
        "--reference",
        action="store_true",
        help="a live frozen reference: grpo / ppo KL, dpo with reference=live (precompute needs none); "
        "a weights copy with full fine-tuning, the base with adapters off with LoRA; not rm",
    )
    train.add_argument(
        "--checkpointing",
        action="store_true",
        help="total_bytes with activation checkpointing (both figures are always shown)",
    )

    device = parser.add_argument_group("device")
    device.add_argument(
        "--device",
        choices=tuple(DEVICES),
        default="cpu",
        help="device kind: default throughput, bandwidth, memory and overhead (default cpu)",
    )
    device.add_argument(
        "--tflops", type=float, default=None, help="achieved TFLOPS (default: the device's peak x 0.4; cpu: 0.06)"
    )
    device.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (rollout decoding)")
    device.add_argument(
        "--overhead",
        type=parse_size,
        default=None,
        help="runtime overhead, e.g. 300MiB (default: the device's; 0 to leave it out)",
    )
    add_json_argument(parser)


def architecture(args: argparse.Namespace) -> tuple[Architecture, str]:
    """The architecture and a description of where it came from."""
    shapes = {name: getattr(args, name) for name in ARCH_ARGS if getattr(args, name) is not None}
    if args.params is not None:
        if args.model is not None:
            raise PosttrainError("give --model or --params, not both")
        missing = [f"--{n}" for n in ("layers", "hidden") if n not in shapes]
        if missing:
            raise PosttrainError(
                f"--params needs {' and '.join(missing)} (the shapes set activations and the KV cache)"
            )
        return Architecture.from_params(args.params, tied_embeddings=args.tied, **shapes), f"--params {args.params}"
    if shapes or args.tied:
        raise PosttrainError("--layers / --hidden / ... describe a hypothetical model: use them with --params")
    name = args.model or DEFAULT_MODEL
    return Architecture.from_model(name), name


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    kind = device_kind(args.device)
    dtype = args.dtype or ("float32" if kind.name == "cpu" else "bfloat16")
    targets = (
        ALL_LINEARS
        if args.lora_targets == "all-linear"
        else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    )
    return TrainingSetup(
        method=args.method,
        optimizer=args.optimizer,
        dtype=dtype,
        mixed=args.mixed,
        zero=args.zero,
        gpus=args.gpus,
        batch=args.batch,
        seq_len=args.seq_len,
        prompt_len=args.prompt_len,
        grad_accum=args.grad_accum,
        trainer=args.trainer,
        group_size=args.group_size,
        rollout_seqs=args.rollout_seqs,
        kv_tokens=args.kv_tokens,
        lora_r=args.lora_r,
        lora_targets=targets,
        quant_bits=args.quant_bits,
        quant_group=args.quant_group,
        reference=args.reference,
        checkpointing=args.checkpointing,
        overhead_bytes=kind.overhead_bytes if args.overhead is None else args.overhead,
    )


def estimate(args: argparse.Namespace) -> dict:
    """The whole estimate as one flat dict (the --json output)."""
    arch, source = architecture(args)
    setup = setup_from_args(args)
    kind = device_kind(args.device)
    memory = estimate_memory(arch, setup)
    time = estimate_time(
        arch, setup, weights_bytes(arch, setup), args.tflops or kind.tflops, args.bandwidth or kind.bandwidth_gbs
    )
    out = {
        "model": source,
        "device": kind.name,
        "method": setup.method,
        "dtype": setup.dtype,
        "trainer": setup.trainer,
        "zero": setup.zero,
        "gpus": setup.gpus,
        **memory.as_dict(),
        **time.as_dict(),
    }
    out["device_memory_bytes"] = kind.memory_bytes
    out["fits"] = None if kind.memory_bytes is None else memory.total_bytes <= kind.memory_bytes
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run(args: argparse.Namespace) -> int:
    result = estimate(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['model']}: {result['parameters'] / 1e6:.1f}M parameters, {result['trainable_parameters'] / 1e6:.2f}M "
        f"trainable ({result['method']}, {result['dtype']}, {result['trainer']}, ZeRO-{result['zero']} over "
        f"{result['gpus']} device(s)); per device:"
    )
    rows = [
        ("weights", "weights_bytes"),
        ("gradients", "grads_bytes"),
        ("optimizer states", "optimizer_bytes"),
        ("activations", "activations_bytes"),
        ("  with checkpointing", "activations_checkpointed_bytes"),
        ("loss head (logits)", "logits_bytes"),
        ("rollout KV cache", "kv_cache_bytes"),
        ("reference model", "reference_bytes"),
        ("runtime overhead", "runtime_overhead_bytes"),
        ("peak", "total_uncheckpointed_bytes"),
        ("peak, checkpointed", "total_checkpointed_bytes"),
    ]
    chosen = "total_checkpointed_bytes" if args.checkpointing else "total_uncheckpointed_bytes"
    for label, key in rows:
        mark = "  <- total_bytes" if key == chosen else ""
        print(f"  {label:<22}{_human(result[key]):>12}{mark}")
    print(f"  (peak = weights + optimizer + KV cache + reference + overhead + {result['peak_rule']}; docs/estimate.md)")
    if result["device"] == "cpu":
        print(
            "  (CPU: a run's resident memory matches this with model.cpu_memory=release; with glibc's own policy, "
            "the default, it runs 10-30% higher)"
        )
    if result["fits"] is not None:
        print(
            f"  fits in one {result['device']} ({_human(result['device_memory_bytes'])}): "
            f"{'yes' if result['fits'] else 'no'}"
        )
    line = f"time per step: {result['step_seconds']:.3g} s at {result['tflops']:g} TFLOPS ({result['train_flops']:.3g} FLOPs"
    if result["rollout_flops"]:
        line += f"; rollout {result['rollout_seconds']:.3g} s of it"
    print(line + ")")
    return 0

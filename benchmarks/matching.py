"""Both sides of an A-versus-B training benchmark at the same precision, and the JSON line's record of each side.

    parser.add_argument("--precision", **PRECISION_ARGUMENT)       # fp32 (default) | bf16, both sides alike
    overrides.append(f"model.dtype={posttrain_model_dtype(args.precision)}")
    TRLConfig(..., bf16=args.precision == "bf16", gradient_checkpointing=False)
    result["sides"] = {"posttrain": side("float32", threads), "trl": side("float32", threads, ("transformers", "trl"))}

The two precisions compare like with like:
- fp32: posttrain `model.dtype: float32` (fp32 weights, fp32 compute) against TRL's CPU default (fp32).
- bf16: posttrain `model.dtype: auto` on a CPU with fast bf16 (fp32 master weights, forwards under bf16 autocast)
  against TRL's `bf16=True` (the same: fp32 weights, bf16 autocast). posttrain's `model.dtype: bfloat16` would
  hold the weights themselves in bf16, which TRL's side does not; on a CPU without fast bf16 `auto` computes in
  fp32, and `require_bf16_autocast` refuses the pairing rather than report a bf16 figure that is not one.
Neither side recomputes activations: TRL's `gradient_checkpointing=False` (GRPOConfig turns it on by default),
posttrain's `dist.activation_checkpointing` is off by default.
"""

from __future__ import annotations

import torch
from provenance import package_versions

PRECISIONS = ("fp32", "bf16")
PRECISION_ARGUMENT = {
    "choices": PRECISIONS,
    "default": "fp32",
    "help": "both sides' precision: fp32 (default) or bf16 (autocast over fp32 weights on both)",
}
# What each side computes in, as the JSON line names it.
COMPUTE_NAMES = {"fp32": "float32", "bf16": "bfloat16 autocast over float32 weights"}


def posttrain_model_dtype(precision: str) -> str:
    """posttrain's `model.dtype` for `precision` (see the module docstring for why bf16 is `auto`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return "float32" if precision == "fp32" else "auto"


def update_autocast(run) -> torch.dtype | None:  # noqa: ANN001
    """The dtype a posttrain RL run's update autocasts to (None: it computes in the weights' dtype)."""
    autocast = run.parallel.compute_autocast
    return autocast[1] if autocast is not None else None


def require_bf16_autocast(precision: str, autocast: torch.dtype | None) -> None:
    """Refuses a bf16 pairing whose posttrain side would not autocast to bf16 (a CPU without fast bf16)."""
    if precision == "bf16" and autocast != torch.bfloat16:
        raise SystemExit(
            "--precision bf16: posttrain's model.dtype=auto computes in float32 on this CPU (no fast bf16, "
            "`posttrain info`), so the pairing would not be bf16 against bf16; run --precision fp32"
        )


def side(
    compute: str, threads: int, packages: tuple[str, ...] = ("posttrain",), gradient_checkpointing: bool = False
) -> dict[str, object]:
    """One side's settings for the JSON line: what it computes in, threads, recomputation and package versions."""
    return {
        "compute": compute,
        "threads": threads,
        "gradient_checkpointing": gradient_checkpointing,
        "versions": package_versions(("torch", *packages)),
    }

"""`posttrain quantize --model M --scheme S --out DIR`: write a quantized model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.commands.common import add_model_arguments
from posttrain.errors import PosttrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from posttrain.quant.schemes import SCHEMES

    add_model_arguments(parser)
    parser.add_argument("--scheme", required=True, help=f"one of: {', '.join(SCHEMES)}")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def run(args: argparse.Namespace) -> int:
    from posttrain.models.hub import load_model
    from posttrain.quant import get_scheme, quantize_model, save_quantized

    scheme = get_scheme(args.scheme)  # fail on a bad name before loading anything
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise PosttrainError(f"{out}: already exists and is not empty (use --force to replace it)")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device or "cpu")
    quantize_model(model, scheme)
    save_quantized(model, out, tokenizer)
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {out} ({scheme.name}, {size / 2**20:.1f} MiB of weights)")
    return 0

"""`posttrain convert --model M --out DIR [--dtype D]`: write an HF directory (weights, config, tokenizer)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.commands.common import add_model_arguments
from posttrain.errors import PosttrainError
from posttrain.models.checkpoint_io import parse_dtype, save_hf_dir
from posttrain.models.hub import load_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise PosttrainError(f"{out}: already exists and is not empty (use --force to replace it)")
    dtype = parse_dtype(args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype, device="cpu")
    save_hf_dir(model, out, tokenizer=tokenizer, dtype=dtype)
    print(f"wrote {out} ({model.config.model_type}, {model.num_parameters() / 1e6:.1f}M parameters, {model.dtype})")
    return 0

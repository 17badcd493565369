"""`posttrain convert --model M --out DIR [--dtype D] [--num-layers N | --keep-layers I,J,...]`: write an HF
directory (weights, config, tokenizer), optionally with only some decoder layers (a distillation student)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.commands.common import add_model_arguments, add_out_arguments, check_out_argument
from posttrain.models.checkpoint_io import parse_dtype, save_hf_dir
from posttrain.models.hub import load_model
from posttrain.trainers.distill_student import evenly_spaced_layers, keep_layers, parse_layer_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_out_arguments(parser)
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="keep N evenly spaced decoder layers, the first included (30 -> 15: every other layer)",
    )
    layers.add_argument("--keep-layers", default=None, help="keep these decoder layers, e.g. 0,2,4 (increasing)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_out_argument(out, args.force)
    dtype = parse_dtype(args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype, device="cpu")
    total = model.config.num_hidden_layers
    keep = (
        evenly_spaced_layers(total, args.num_layers)
        if args.num_layers is not None
        else parse_layer_list(args.keep_layers, total)
        if args.keep_layers is not None
        else None
    )
    if keep is not None:
        model = keep_layers(model, keep)
        print(f"kept {len(keep)} of {total} layers: {','.join(map(str, keep))}")
    save_hf_dir(model, out, tokenizer=tokenizer, dtype=dtype)
    print(f"wrote {out} ({model.config.model_type}, {model.num_parameters() / 1e6:.1f}M parameters, {model.dtype})")
    return 0

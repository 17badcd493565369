"""`posttrain lora-merge --model M --adapter DIR --out OUT`: merge a PEFT LoRA adapter into its base model and
write a plain HF directory (weights, config, and the tokenizer when the base has one)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from posttrain.commands.common import add_out_arguments, check_out_argument
from posttrain.models.checkpoint_io import load_hf_dir, parse_dtype, save_hf_dir
from posttrain.models.hub import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from posttrain.peft.lora import merge_and_unload
from posttrain.peft.peft_format import load_peft_adapter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"base model: HF directory, .gguf file or known name (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--adapter", required=True, help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)"
    )
    add_out_arguments(parser)
    parser.add_argument(
        "--dtype",
        default=None,
        help="dtype of the saved weights: float32 | bfloat16 | float16 "
        "(default: float32; the merge itself is done in float32)",
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_out_argument(out, args.force)
    dtype = parse_dtype(args.dtype)
    path = resolve_model_path(args.model)
    model = load_hf_dir(path, dtype=torch.float32, device="cpu")  # merge in fp32, round once on save
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    load_peft_adapter(model, args.adapter)
    merge_and_unload(model)
    save_hf_dir(model, out, tokenizer=tokenizer, dtype=dtype)
    print(
        f"wrote {out} ({model.config.model_type} + adapter {args.adapter}, merged, "
        f"{str(dtype or model.dtype).removeprefix('torch.')})"
    )
    return 0

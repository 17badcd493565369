"""`posttrain quantize --model M --scheme S --out DIR [--method rtn|gptq --calib-data FILE ...]`: write a
quantized model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.commands.common import add_model_arguments, add_out_arguments, check_out_argument
from posttrain.errors import PosttrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from posttrain.quant.schemes import SCHEMES

    add_model_arguments(parser)
    parser.add_argument("--scheme", required=True, help=f"one of: {', '.join(SCHEMES)}")
    add_out_arguments(parser)
    parser.add_argument(
        "--method",
        choices=("rtn", "gptq"),
        default="rtn",
        help="rtn: round to nearest (default, no data); gptq: error-correcting rounding on "
        "calibration text (needs --calib-data)",
    )
    gptq = parser.add_argument_group("GPTQ calibration (with --method gptq)")
    gptq.add_argument("--calib-data", help="dataset file (JSONL, JSON, Parquet) whose text calibrates the rounding")
    gptq.add_argument("--calib-column", default="text", help="its text column (default: text)")
    gptq.add_argument("--calib-skip", type=int, default=0, help="skip this many rows first (default 0)")
    gptq.add_argument("--calib-samples", type=int, default=128, help="windows of text (default 128)")
    gptq.add_argument("--calib-seq-len", type=int, default=512, help="tokens per window (default 512)")
    gptq.add_argument("--damp", type=float, default=0.01, help="Hessian damping, fraction of its mean diagonal")
    gptq.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="round inputs in order of decreasing activation energy, grids fixed up front (default on)",
    )
    gptq.add_argument(
        "--clip-search",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per group, the clipped range with the least activation-weighted rounding error (default on)",
    )


def run(args: argparse.Namespace) -> int:
    from posttrain.models.hub import load_model
    from posttrain.quant import get_scheme, quantize_model, save_quantized

    scheme = get_scheme(args.scheme)  # fail on a bad name before loading anything
    if args.method == "gptq" and not args.calib_data:
        raise PosttrainError("--method gptq needs calibration text: --calib-data FILE [--calib-column text]")
    if args.method == "rtn" and args.calib_data:
        raise PosttrainError("--calib-data is used by --method gptq only (round to nearest needs no data)")
    out = Path(args.out)
    check_out_argument(out, args.force)
    texts = _calibration_texts(args) if args.method == "gptq" else None  # bad data fails before the model loads
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device or "cpu")
    if texts is not None:
        _gptq(model, tokenizer, scheme, texts, args)
    else:
        quantize_model(model, scheme)
    save_quantized(model, out, tokenizer)
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {out} ({scheme.name}, {args.method}, {size / 2**20:.1f} MiB of weights)")
    return 0


def _calibration_texts(args: argparse.Namespace) -> list[str]:
    from posttrain.eval.perplexity import read_texts

    # enough rows to fill the windows (rows average well over 8 tokens), each kept whole
    return read_texts(
        args.calib_data, args.calib_column, args.calib_skip, max(1, args.calib_samples * args.calib_seq_len // 8)
    )


def _gptq(model, tokenizer, scheme, texts: list[str], args: argparse.Namespace) -> None:
    from posttrain.quant import calibration_batch, gptq_quantize_model

    rows = tokenizer.encode_batch(texts, add_special_tokens=True)
    ids = calibration_batch(rows, args.calib_samples, args.calib_seq_len, tokenizer.eos_token_id)
    print(f"gptq: calibrating on {ids.shape[0]} windows of {ids.shape[1]} tokens from {args.calib_data}")
    gptq_quantize_model(
        model, scheme, ids, damp=args.damp, act_order=args.act_order, clip_search=args.clip_search, progress=True
    )

"""Arguments shared by several commands."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.models.hub import DEFAULT_MODEL
from posttrain.run_dir import check_run_dir_writable
from posttrain.writable import check_writable_dir


def is_main_process() -> bool:
    """False on torchrun's ranks other than 0 (read from the environment: the process group may not exist yet)."""
    return os.environ.get("RANK", "0") == "0"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"HF directory, .gguf file or known name (default: {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)"
    )
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")


def add_quant_argument(parser: argparse.ArgumentParser) -> None:
    """`--quant int8` of the inference commands (posttrain/quant/inference.py)."""
    parser.add_argument(
        "--quant",
        default=None,
        help="int8: int8 weight-only decode, the decoder's linear weights rounded at load in groups of 32 with an "
        "fp16 scale each, llama.cpp's Q8_0 grid (about a quarter of fp32's bytes; default: the model's own weights); "
        "q8_0: the LM head too, as llama.cpp's Q8_0 files (faster at batch 1, a little further from fp32)",
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """`--json`: the command prints its result as one JSON object instead of text."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_out_arguments(parser: argparse.ArgumentParser) -> None:
    """`--out DIR` and `--force` of a command that writes one model directory (convert, quantize, lora-merge)."""
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --force)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def check_out_argument(out: Path, force: bool) -> None:
    """Before the model loads: `out` is free (or `force`), and its parent can be written, since the directory is
    written as a temporary sibling and renamed into place."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise PosttrainError(f"{out}: already exists and is not empty (use --force to replace it)")
    check_writable_dir(out.parent, subject=out)


def add_config_arguments(parser: argparse.ArgumentParser, example: str, distributed: bool = False) -> None:
    """The trainers' one positional: an optional YAML config, then dotted overrides (`example` shows some);
    `distributed`: the trainer has a `dist:` section, and takes `--nproc N`."""
    if distributed:
        parser.add_argument(
            "--nproc",
            type=int,
            default=None,
            metavar="N",
            help="run data-parallel in N processes on this machine (torchrun; set dist.strategy=ddp "
            "or fsdp2, see docs/distributed.md)",
        )
    parser.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="[CONFIG.yaml] [key=value ...]",
        help=f"an optional YAML config, then overrides such as {example}",
    )


def run_logged(train: Callable[[Any], Path], config: Any) -> int:
    """Run an offline trainer with posttrain's INFO log lines on stderr, then print the run directory."""
    if not is_main_process():  # under torchrun rank 0 speaks for the run
        train(config)
        return 0
    # The trainers create the run directory once model and data have loaded (a bad row leaves no run behind);
    # an --out that cannot be written should not wait for that.
    check_run_dir_writable(config.out, config.resume)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("posttrain")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        run_dir = train(config)
    finally:
        package_logger.removeHandler(handler)
    print(run_dir)
    return 0

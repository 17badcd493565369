"""Arguments shared by several commands."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.models.hub import DEFAULT_MODEL


def is_main_process() -> bool:
    """False on torchrun's ranks other than 0 (read from the environment: the process group may not exist yet)."""
    return os.environ.get("RANK", "0") == "0"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file or known name (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")


def add_config_arguments(parser: argparse.ArgumentParser, example: str, distributed: bool = False) -> None:
    """The trainers' one positional: an optional YAML config, then dotted overrides (`example` shows some);
    `distributed`: the trainer has a `dist:` section, and takes `--nproc N`."""
    if distributed:
        parser.add_argument("--nproc", type=int, default=None, metavar="N",
                            help="run data-parallel in N processes on this machine (torchrun; set dist.strategy=ddp "
                                 "or fsdp2, see docs/distributed.md)")
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="[CONFIG.yaml] [key=value ...]",
        help=f"an optional YAML config, then overrides such as {example}",
    )


def run_logged(train: Callable[[Any], Path], config: Any) -> int:
    """Run an offline trainer with posttrain's INFO log lines on stderr, then print the run directory."""
    if not is_main_process():  # under torchrun rank 0 speaks for the run
        train(config)
        return 0
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

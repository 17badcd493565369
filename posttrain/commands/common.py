"""Arguments shared by several commands."""

from __future__ import annotations

import argparse

from posttrain.models.hub import DEFAULT_MODEL


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file or known name (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")

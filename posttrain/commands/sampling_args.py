"""Sampling flags shared by `generate` and `chat`, turned into SamplingParams."""

from __future__ import annotations

import argparse

from posttrain.engine.config import COMPUTE_DTYPES
from posttrain.engine.sampling_params import SamplingParams
from posttrain.errors import PosttrainError


def add_sampling_arguments(parser: argparse.ArgumentParser, default_temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=default_temperature, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 = off")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--seed", type=int, default=None, help="same seed, same output")
    group.add_argument("--max-model-len", type=int, default=None, help="engine context limit (default: model's)")
    add_compute_dtype_argument(group)
    add_decode_steps_argument(group)


def add_decode_steps_argument(group: argparse._ActionsContainer) -> None:
    """--decode-steps, EngineConfig.decode_steps (generate, chat, serve)."""
    group.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="decode steps chained in one native call for greedy or plain temperature sampling (default: 8; 1 = one "
        "step at a time); the same tokens, streamed up to this many at a time",
    )


def add_compute_dtype_argument(group: argparse._ActionsContainer) -> None:
    """--compute-dtype, EngineConfig.compute_dtype (generate, chat, serve)."""
    group.add_argument(
        "--compute-dtype",
        default=None,
        choices=COMPUTE_DTYPES,
        help="the engine's compute dtype: auto = bf16 over fp32 weights on a CPU with fast bf16 (`posttrain info`), "
        "else the weights' dtype (default: auto; with --dtype float32: float32)",
    )


def sampling_params_from_args(args: argparse.Namespace, **overrides) -> SamplingParams:
    fields = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.seed,
    )
    fields.update(overrides)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise PosttrainError(str(exc)) from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags: --max-model-len, --compute-dtype, --decode-steps, and the speculative decoding flags when
    the command has them (commands/speculative_args.py)."""
    from posttrain.commands.speculative_args import speculative_config

    kwargs: dict = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if args.compute_dtype is not None:
        kwargs["compute_dtype"] = args.compute_dtype
    if args.decode_steps is not None:
        kwargs["decode_steps"] = args.decode_steps
    if hasattr(args, "speculative"):
        speculative = speculative_config(args)
        if speculative is not None:
            kwargs["speculative"] = speculative
    return kwargs

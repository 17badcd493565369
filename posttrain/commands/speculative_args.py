"""Speculative decoding flags shared by `generate`, `chat` and `serve`, turned into EngineConfig.speculative."""

from __future__ import annotations

import argparse

from posttrain.engine.speculative.config import METHODS, SpeculativeConfig
from posttrain.errors import PosttrainError


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (docs/engine.md)")
    group.add_argument(
        "--speculative",
        choices=METHODS,
        default=None,
        help="draft tokens by n-gram lookup in the prompt and output, or with --draft-model; the model checks "
        "them in one forward (greedy output unchanged, sampled output from the same distribution)",
    )
    group.add_argument(
        "--num-speculative-tokens", type=int, default=None, metavar="K", help="drafts per step (default: 4)"
    )
    group.add_argument("--ngram-max", type=int, default=None, metavar="N", help="longest n-gram looked up (default: 4)")
    group.add_argument(
        "--fixed-drafts",
        action="store_true",
        help="check every proposed draft; by default only as many as the acceptance rate so far pays for, none "
        "where drafts are mostly rejected (docs/engine.md)",
    )
    group.add_argument(
        "--draft-model",
        default=None,
        metavar="NAME|DIR",
        help="a smaller model with the same tokenizer (e.g. from `posttrain convert --num-layers N`); implies "
        "--speculative draft",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The flags as a SpeculativeConfig, or None when speculative decoding is off; a bad combination is one line."""
    method = args.speculative or ("draft" if args.draft_model is not None else None)
    if method is None:
        given = [
            flag
            for flag, value in (
                ("--num-speculative-tokens", args.num_speculative_tokens),
                ("--ngram-max", args.ngram_max),
                ("--fixed-drafts", args.fixed_drafts or None),
            )
            if value is not None
        ]
        if given:
            raise PosttrainError(f"{given[0]} needs --speculative ngram|draft (or --draft-model)")
        return None
    if method == "ngram" and args.draft_model is not None:
        raise PosttrainError("--draft-model goes with --speculative draft, not ngram")
    if method == "draft" and args.draft_model is None:
        raise PosttrainError("--speculative draft needs --draft-model NAME|DIR")
    if method == "draft" and args.ngram_max is not None:
        raise PosttrainError("--ngram-max goes with --speculative ngram")
    fields: dict = {"method": method, "draft_model": args.draft_model, "adaptive": not args.fixed_drafts}
    if args.num_speculative_tokens is not None:
        fields["num_tokens"] = args.num_speculative_tokens
    if args.ngram_max is not None:
        fields["ngram_max"] = args.ngram_max
        fields["ngram_min"] = min(SpeculativeConfig.ngram_min, args.ngram_max)
    try:
        return SpeculativeConfig(**fields)
    except ValueError as error:
        flag = {"num_tokens": "--num-speculative-tokens", "ngram_max": "--ngram-max"}
        message = str(error)
        for name, option in flag.items():
            message = message.replace(f"speculative.{name}", option)
        raise PosttrainError(message) from None

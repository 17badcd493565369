"""`posttrain eval preference`: pairwise preference accuracy of a reward model or of a DPO policy's
implicit reward (see posttrain/eval/preference.py).

    posttrain eval preference --data PAIRS --reward-model RM_DIR [--json]
    posttrain eval preference --data PAIRS --model POLICY --ref-model REF [--beta 0.1] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from posttrain.commands.common import add_json_argument
from posttrain.errors import PosttrainError


def preference_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="preference pairs: prompt/chosen/rejected or chosen/rejected rows (text or chat), "
        "or hh-rlhf transcripts; JSONL(.gz), JSON, Parquet",
    )
    scorer = parser.add_argument_group("scorer (one of)")
    scorer.add_argument("--reward-model", default=None, help="a reward-model directory (`posttrain rm`'s final/)")
    scorer.add_argument("--model", default=None, help="a DPO policy (HF directory, .gguf or known name)")
    scorer.add_argument("--ref-model", default=None, help="the DPO reference model (with --model)")
    scorer.add_argument("--beta", type=float, default=0.1, help="DPO beta of the implicit reward (default 0.1)")
    data = parser.add_argument_group("data")
    data.add_argument("--format", default="auto", help="row format: auto, preference, implicit_preference, hh_rlhf")
    data.add_argument("--max-rows", type=int, default=None, help="read only the first N rows")
    data.add_argument("--max-length", type=int, default=1024, help="tokens per sequence (default 1024)")
    data.add_argument(
        "--overlong",
        choices=("truncate", "skip"),
        default="truncate",
        help="a longer sequence: cut (default; the RM keeps the last tokens) or skip the pair as bad",
    )
    data.add_argument(
        "--max-bad-row-fraction",
        type=float,
        default=0.0,
        help="fail when more than this fraction of rows is bad (default 0: any bad row fails)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences scored together (default 8)")
    parser.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)"
    )
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    add_json_argument(parser)


def _data_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "format": args.format,
        "max_rows": args.max_rows,
        "max_length": args.max_length,
        "overlong": args.overlong,
        "max_bad_row_fraction": args.max_bad_row_fraction,
    }


def preference_run(args: argparse.Namespace) -> int:
    from posttrain.eval.preference import evaluate_dpo, evaluate_reward_model

    if args.batch_size < 1:
        raise PosttrainError(f"--batch-size must be >= 1, got {args.batch_size}")
    if (args.reward_model is None) == (args.model is None):
        raise PosttrainError("give --reward-model DIR, or --model POLICY with --ref-model REF (not both)")
    if args.reward_model is not None:
        if args.ref_model is not None:
            raise PosttrainError("--ref-model goes with --model (a DPO policy), not with --reward-model")
        result = evaluate_reward_model(
            args.reward_model,
            args.data,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            progress=True,
            **_data_options(args),
        )
        scorer = {"reward_model": str(args.reward_model)}
    else:
        if args.ref_model is None:
            raise PosttrainError(
                "--model (a DPO policy) needs --ref-model REF: the implicit reward is beta * (logp_policy - logp_ref)"
            )
        if not args.beta > 0:
            raise PosttrainError(f"--beta must be > 0, got {args.beta}")
        from posttrain.models.hub import load_model

        policy, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
        reference, _ = load_model(args.ref_model, dtype=args.dtype, device=args.device)
        result = evaluate_dpo(
            policy,
            reference,
            tokenizer,
            args.data,
            beta=args.beta,
            batch_size=args.batch_size,
            progress=True,
            **_data_options(args),
        )
        scorer = {"model": str(args.model), "ref_model": str(args.ref_model), "beta": args.beta}
    if args.json:
        print(json.dumps({"task": "preference", "data": str(args.data), **scorer, **result.to_dict()}))
        return 0
    print(
        f"preference accuracy {result.accuracy:.4f} (ties count half)  mean margin {result.mean_margin:.4f}  "
        f"({result.pairs} pairs: {result.wins} won, {result.ties} tied, {result.losses} lost; "
        f"{result.data_report.get('bad_rows', 0)} bad rows skipped)"
    )
    return 0

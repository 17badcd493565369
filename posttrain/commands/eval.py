"""`posttrain eval <task> ...`: evaluation tasks, one registry entry each.

    posttrain eval ppl --model M --data FILE [--column answer] [--skip N] [--max-rows N] [--max-length L] [--json]
    posttrain eval accuracy --task arithmetic|gsm8k | --data FILE --reward SPEC [--n K --temperature T --k 1,4] [--json]
    posttrain eval accuracy --config RL.yaml --data FILE [--json]   (greedy episodes in the config's environment)
    posttrain eval em-f1 --data FILE [--answer-column C] [--extract REGEX] [--json]
    posttrain eval preference --data PAIRS (--reward-model DIR | --model POLICY --ref-model REF --beta B) [--json]

A task is a help line, a function that adds its arguments and a function that runs it; add one by adding
an entry to TASKS.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

from posttrain.commands.common import add_json_argument, add_model_arguments
from posttrain.commands.eval_episodes import episodes_accuracy_run
from posttrain.commands.eval_generation import accuracy_arguments, accuracy_run, em_f1_arguments, em_f1_run
from posttrain.commands.eval_preference import preference_arguments, preference_run
from posttrain.writable import check_writable_file


@dataclass(frozen=True)
class EvalTask:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- ppl --------------------------------------------------------------------------------------------


def _ppl_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--data", required=True, help="dataset file (JSONL, JSON, Parquet) with a text column")
    parser.add_argument("--column", default="text", help="the column holding the text (default: text; GSM8K: answer)")
    parser.add_argument("--skip", type=int, default=0, help="skip this many rows first (e.g. to score the last ones)")
    parser.add_argument("--max-rows", type=int, default=None, help="score at most this many rows")
    parser.add_argument(
        "--max-length", type=int, default=1024, help="tokens per row, longer rows are cut (default 1024)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows the engine prefills together (default 8)")
    add_json_argument(parser)


def _ppl_run(args: argparse.Namespace) -> int:
    from posttrain.eval.perplexity import evaluate_perplexity
    from posttrain.models.hub import load_model  # also reads `posttrain quantize` directories

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    result = evaluate_perplexity(
        model,
        tokenizer,
        args.data,
        args.column,
        args.skip,
        args.max_rows,
        args.max_length,
        args.batch_size,
        progress=True,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "task": "ppl",
                    "model": str(args.model),
                    "data": str(args.data),
                    "column": args.column,
                    "skip": args.skip,
                    "max_length": args.max_length,
                    **result.to_dict(),
                }
            )
        )
    else:
        print(
            f"perplexity {result.perplexity:.4f}  (mean NLL {result.mean_nll:.4f} nats over {result.tokens} tokens, "
            f"{result.rows} rows, {result.truncated_rows} cut to {args.max_length} tokens)"
        )
    return 0


def _accuracy_run(args: argparse.Namespace) -> int:
    """`--config RL.yaml`: greedy episodes in its environment; else completions scored by rewards."""
    return episodes_accuracy_run(args) if args.config is not None else accuracy_run(args)


TASKS: dict[str, EvalTask] = {
    "ppl": EvalTask("perplexity on held-out text (a JSONL text column)", _ppl_arguments, _ppl_run),
    "accuracy": EvalTask(
        "task accuracy and pass@k of generated answers (built-in task, or a file + a reward)",
        accuracy_arguments,
        _accuracy_run,
    ),
    "em-f1": EvalTask(
        "exact match and token F1 of generated answers against a reference column", em_f1_arguments, em_f1_run
    ),
    "preference": EvalTask(
        "pairwise preference accuracy of a reward model or a DPO policy's implicit reward",
        preference_arguments,
        preference_run,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    for name, task in TASKS.items():
        task.add_arguments(sub.add_parser(name, help=task.help, description=task.help))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "samples", None) is not None:  # written at the end: an unwritable path must not wait for it
        check_writable_file(args.samples)
    return TASKS[args.task].run(args)

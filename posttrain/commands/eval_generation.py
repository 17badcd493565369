"""`posttrain eval accuracy` and `posttrain eval em-f1`: arguments and runs of the evaluations that
generate with the engine (see posttrain/eval/accuracy.py and em_f1.py for what they count).

    posttrain eval accuracy --task arithmetic|gsm8k [--num 100] | --data FILE --reward SPEC [--answer-column C]
                            [--n K --temperature T --seed S --k 1,4] [--threshold 1.0] [--json]
    posttrain eval em-f1 --data FILE [--prompt-column C] [--answer-column C] [--extract REGEX] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from posttrain.commands.common import add_json_argument, add_model_arguments
from posttrain.errors import PosttrainError

# --max-tokens when not given: a two-digit sum needs a few tokens, a GSM8K solution a few hundred.
DEFAULT_MAX_TOKENS = {"arithmetic": 32, "gsm8k": 256}


def parse_ks(values: list[str]) -> list[int]:
    """`--k 1,4` or `--k 1 4` -> [1, 4]."""
    out = []
    for value in values:
        for part in filter(None, value.split(",")):
            try:
                out.append(int(part))
            except ValueError:
                raise PosttrainError(f"--k: {part!r} is not an integer (e.g. --k 1,4)") from None
    return out


def _data_arguments(
    parser: argparse.ArgumentParser,
    answer_help: str,
    num_help: str = "evaluate the first N rows of --data (default: all)",
) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data", type=Path, default=None, help="dataset file (JSONL, JSON, Parquet) or saved HF dataset"
    )
    group.add_argument(
        "--prompt-column",
        default="prompt",
        help="the prompt: text or chat messages (default: prompt; question when the file has that instead)",
    )
    group.add_argument("--answer-column", default="answer", help=answer_help)
    group.add_argument(
        "--prompt-template",
        default=None,
        help="build a text prompt from the row's columns, e.g. '{question}\\nAnswer briefly.'",
    )
    group.add_argument("--system", default=None, help="a system message before text prompts")
    group.add_argument("--num", type=int, default=None, help=num_help)


def _generation_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    group = parser.add_argument_group("generation")
    group.add_argument("--n", type=int, default=1, help="samples per problem (default 1)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same samples; default 0)")
    group.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per completion (default: 32 for --task arithmetic, else 256)",
    )
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine context limit (default: the longest prompt + --max-tokens)",
    )
    parser.add_argument(
        "--samples",
        type=Path,
        default=None,
        help="write the first samples (prompt, completion, score) to this JSONL file",
    )
    add_json_argument(parser)


def _sampling(args: argparse.Namespace, task: str | None) -> Any:
    from posttrain.eval.generation import Sampling

    max_tokens = args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS.get(task or "", 256)
    return Sampling(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _rows(args: argparse.Namespace, task: str | None) -> Any:
    from posttrain.eval.prompts import file_rows, task_rows

    if args.num is not None and args.num < 1:
        raise PosttrainError(f"--num must be >= 1, got {args.num}")
    if task is not None:
        if args.data is not None:
            raise PosttrainError("give --task or --data, not both (a task's own data file is --task-data)")
        return task_rows(task, args.num or 100, getattr(args, "task_data", None))
    if args.data is None:
        raise PosttrainError(
            "no prompts: give --data FILE" + (" or --task NAME" if hasattr(args, "builtin_task") else "")
        )
    return file_rows(
        args.data,
        prompt_column(args),
        args.answer_column,
        max_rows=args.num,
        system_prompt=args.system,
        template=args.prompt_template,
    )


def prompt_column(args: argparse.Namespace) -> str:
    """`--prompt-column`, or `question` when the flag is left at `prompt` and the file's first row has no such
    column but a `question` (the calculator problems' format)."""
    from posttrain.data.readers import read_rows

    if args.prompt_column != "prompt":
        return args.prompt_column
    for _, record in read_rows(args.data):
        return "question" if "prompt" not in record and "question" in record else "prompt"
    return "prompt"


def _engine(args: argparse.Namespace, rows: list[dict[str, Any]], sampling: Any) -> Any:
    from posttrain.eval.generation import make_engine

    return make_engine(
        args.model, rows, sampling, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len
    )


def write_samples(path: Path | None, records: list[dict[str, Any]]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _header(args: argparse.Namespace, name: str, source: str, sampling: Any) -> dict[str, Any]:
    return {
        "task": name,
        "model": str(args.model),
        "data": source,
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "max_tokens": sampling.max_tokens,
    }


# ---- accuracy ---------------------------------------------------------------------------------------


def accuracy_arguments(parser: argparse.ArgumentParser) -> None:
    from posttrain.tasks import TASKS

    # dest: `args.task` is the eval subcommand's name (posttrain eval <task>)
    parser.add_argument(
        "--task",
        dest="builtin_task",
        choices=sorted(TASKS),
        default=None,
        help="a built-in task's held-out problems (its own reward unless --reward is given)",
    )
    parser.add_argument("--task-data", default=None, help="the task's data file (gsm8k: a train.jsonl)")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="an RL config with an env: section: each --data row is played as one greedy episode in its "
        "environment, with its tools (docs/agents.md)",
    )
    _data_arguments(
        parser,
        "the reference answer, given to the reward as `answer` (default: answer)",
        "problems to evaluate: the first N rows of --data, or N held-out problems of --task "
        "(default: all rows; 100 task problems)",
    )
    parser.add_argument(
        "--reward",
        action="append",
        default=[],
        help="reward spec: a built-in (numeric_match, gsm8k, boxed, ...) or path/to/file.py:function; "
        "repeatable, the total is the sum",
    )
    parser.add_argument("--threshold", type=float, default=1.0, help="a sample is correct when reward >= this (1.0)")
    parser.add_argument("--k", nargs="+", default=None, help="pass@k for these k (e.g. --k 1,4; default: 1 and n)")
    _generation_arguments(parser)


def accuracy_run(args: argparse.Namespace) -> int:
    from posttrain.eval.accuracy import NO_REWARD, evaluate_accuracy, row_columns
    from posttrain.eval.pass_at_k import check_ks
    from posttrain.rewards import load_reward_specs

    sampling = _sampling(args, args.builtin_task)
    sampling.validate()
    ks = check_ks(parse_ks(args.k) if args.k else (1, sampling.n), sampling.n)
    if not args.reward and args.builtin_task is None:
        raise PosttrainError(
            "no reward function: with --data, name one with --reward (a built-in, e.g. "
            "numeric_match, or path/to/file.py:function)"
        )
    data = _rows(args, args.builtin_task)
    specs = args.reward or ([data.default_reward] if data.default_reward else [])
    if not specs:
        raise PosttrainError(NO_REWARD)
    reward_specs = load_reward_specs(specs, row_columns(data.rows))  # bad specs fail before the model loads
    result = evaluate_accuracy(
        _engine(args, data.rows, sampling),
        data.rows,
        reward_specs,
        sampling=sampling,
        ks=ks,
        threshold=args.threshold,
        progress=True,
    )
    write_samples(args.samples, result.records)
    if args.json:
        print(json.dumps({**_header(args, "accuracy", data.source, sampling), "reward": specs, **result.to_dict()}))
        return 0
    acc = "n/a (nothing scorable)" if result.accuracy is None else f"{result.accuracy:.4f}"
    print(
        f"accuracy {acc}  ({result.correct} correct of {result.scorable} scorable samples; "
        f"{result.unscorable} unscorable; {result.problems} problems x {result.samples_per_problem})"
    )
    for k, value in result.pass_at_k.items():
        print(f"pass@{k} {value:.4f}  (over {result.problems_for_k[k]} problems)")
    for message in result.reward_errors:
        print(f"reward error: {message}")
    return 0


# ---- em-f1 ------------------------------------------------------------------------------------------


def em_f1_arguments(parser: argparse.ArgumentParser) -> None:
    _data_arguments(parser, "the reference: a string or a list of strings (default: answer)")
    parser.add_argument(
        "--extract",
        default=None,
        help="regex that pulls the answer out of the completion (last match; its group 'answer' "
        "or first group if any), e.g. 'Answer:\\s*(.*)'",
    )
    _generation_arguments(parser)


def em_f1_run(args: argparse.Namespace) -> int:
    from posttrain.eval.em_f1 import compile_extract, evaluate_em_f1

    sampling = _sampling(args, None)
    sampling.validate()
    compile_extract(args.extract)
    data = _rows(args, None)
    result = evaluate_em_f1(
        _engine(args, data.rows, sampling),
        data.rows,
        extract=args.extract,
        sampling=sampling,
        locations=data.locations,
        progress=True,
    )
    write_samples(args.samples, result.records)
    if args.json:
        print(
            json.dumps({**_header(args, "em-f1", data.source, sampling), "extract": args.extract, **result.to_dict()})
        )
        return 0
    if result.exact_match is None:
        print(f"exact match n/a, F1 n/a: no sample has a reference ({result.unscorable} unscorable)")
    else:
        print(
            f"exact match {result.exact_match:.4f}  F1 {result.f1:.4f}  ({result.scorable} scorable samples, "
            f"{result.unscorable} without a reference, {result.no_match} without an --extract match)"
        )
    return 0

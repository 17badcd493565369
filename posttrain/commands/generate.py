"""`posttrain generate --prompt TEXT [--prompt ...] [--prompts-file F]`: completions from the rollout engine.

One prompt with n=1 streams tokens to stdout as they come; several prompts run as one continuous batch
with a progress bar. Prompts are chat messages for the model's chat template unless `--raw` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.commands.common import add_model_arguments, add_quant_argument
from posttrain.commands.sampling_args import add_sampling_arguments, engine_kwargs, sampling_params_from_args
from posttrain.commands.speculative_args import add_speculative_arguments
from posttrain.commands.text_input import check_argument, json_text_problem, read_text_lines
from posttrain.data.readers import read_rows
from posttrain.errors import PosttrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_quant_argument(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument(
        "--prompts-file",
        type=Path,
        help="JSONL with a `prompt` (text or messages) or `messages` column, or a .txt file with one prompt a line",
    )
    parser.add_argument("--system", default=None, help="system message for chat prompts")
    parser.add_argument("--raw", action="store_true", help="send prompt text as-is, without the chat template")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--logprobs", action="store_true", help="include per-token logprobs (with --json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_sampling_arguments(parser, default_temperature=0.0)
    add_speculative_arguments(parser)


def read_prompts_file(path: Path) -> list[Any]:
    """Prompts of a .jsonl file (read as the dataset readers read it) or of a text file (one prompt a line)."""
    if not path.is_file():
        raise PosttrainError(f"{path}: no such file")
    if path.suffix != ".jsonl":
        return [line for _, line in read_text_lines(path) if line.strip()]
    prompts = []
    for line_no, row in read_rows(path):
        key = "prompt" if "prompt" in row else "messages"
        prompt = row.get(key)
        if prompt is None:
            raise PosttrainError(f"{path}:{line_no}: no `prompt` or `messages` field")
        problem = json_text_problem(prompt)
        if problem is not None:
            raise PosttrainError(f"{path}:{line_no}: {key}: a string {problem[1]}")
        prompts.append(prompt)
    return prompts


def command_line_prompts(args: argparse.Namespace) -> list[str]:
    """The --prompt values, each checked to be UTF-8 (and --system with them)."""
    if args.system is not None:
        check_argument(args.system, "--system")
    many = len(args.prompt) > 1
    return [check_argument(p, f"--prompt #{i}" if many else "--prompt") for i, p in enumerate(args.prompt, 1)]


def as_engine_prompt(prompt: Any, raw: bool, system: str | None) -> Any:
    if not isinstance(prompt, str) or raw:
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": prompt}]


def run(args: argparse.Namespace) -> int:
    from posttrain.engine.llm import LLM

    prompts = command_line_prompts(args) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise PosttrainError("no prompt: give --prompt TEXT or --prompts-file FILE")
    params = sampling_params_from_args(args, n=args.n, logprobs=True if args.logprobs else None)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quant=args.quant, **engine_kwargs(args))
    engine_prompts = [as_engine_prompt(p, args.raw, args.system) for p in prompts]
    if len(prompts) == 1 and args.n == 1 and not args.json:
        for delta in llm.stream(engine_prompts[0], params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    outputs = llm.generate(engine_prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "outputs": [
                            {
                                "text": o.text,
                                "token_ids": o.token_ids,
                                "finish_reason": o.finish_reason,
                                **({"logprobs": o.logprobs} if args.logprobs else {}),
                            }
                            for o in out.outputs
                        ],
                    }
                )
            )
            continue
        for o in out.outputs:
            header = f"--- {prompt if isinstance(prompt, str) else json.dumps(prompt)}"
            print(header if args.n == 1 else f"{header} [{o.index}]")
            print(o.text)
    return 0

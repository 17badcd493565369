"""Synthetic tool-use transcripts for the calculator environment: an SFT cold start before agentic RL.

Each row is a conversational SFT example that `posttrain sft` trains as is (the `messages` format with a
`tools` column, rendered by the chat template with its tools, as TRL does):

    {"messages": [{"role": "system", "content": <the environment's system prompt>},
                  {"role": "user", "content": "What is 347 times 29?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
                       "function": {"name": "calculator", "arguments": {"expression": "347 * 29"}}}]},
                  {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "10063"},
                  {"role": "assistant", "content": "The answer is 10063."}],
     "tools": [<the calculator's schema>]}

The conversation is exactly what the calculator environment produces for a model that solves the problem
(same system prompt, tool result from the real tool, final answer in the format its reward reads). Problems
come from the multiplication task's training draws (never its held-out pairs).

    python -m posttrain.envs.transcripts --out calculator_sft.jsonl --rows 2000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from posttrain.envs.builtin_tools import calculator
from posttrain.envs.calculator import FINAL_ANSWER, SYSTEM_PROMPT
from posttrain.envs.tools import as_tool, run_tool_call
from posttrain.envs.turns import ParsedTurn, ToolCall
from posttrain.tasks.multiplication import MultiplicationTask

_OPERANDS = re.compile(r"(\d+)\D+(\d+)")


def calculator_transcript(row: dict[str, Any], system_prompt: str = SYSTEM_PROMPT) -> dict[str, Any]:
    """The solved episode of one multiplication row (see the module docstring)."""
    question = row["prompt"][-1]["content"]
    a, b = _OPERANDS.search(question).groups()  # type: ignore[union-attr]  # the task's prompts hold both numbers
    tool = as_tool(calculator)
    call = ToolCall(name=tool.name, arguments={"expression": f"{a} * {b}"}, id="call_0")
    result, _ = run_tool_call({tool.name: tool}, call)
    if result["content"] != row["answer"]:
        raise AssertionError(f"calculator said {result['content']} for {a} * {b}, the task says {row['answer']}")
    messages = [
        {"role": "system", "content": system_prompt},
        *row["prompt"],
        ParsedTurn(text="", content="", tool_calls=[call]).as_message(),
        result,
        {"role": "assistant", "content": FINAL_ANSWER.format(answer=result["content"])},
    ]
    return {"messages": messages, "tools": [tool.schema]}


def calculator_transcripts(rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """`rows` solved episodes over fresh training problems of the multiplication task drawn from `seed`."""
    return [calculator_transcript(row) for row in MultiplicationTask(seed=seed).sample(rows)]


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m posttrain.envs.transcripts", description="Write calculator tool-use SFT transcripts (JSONL)."
    )
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--rows", type=int, default=1000, help="how many transcripts (default: 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the multiplication task's seed (default: 0)")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be positive, got {args.rows}")
    path = write_jsonl(args.out, calculator_transcripts(args.rows, args.seed))
    print(f"wrote {args.rows} transcripts to {path}")


if __name__ == "__main__":
    main()

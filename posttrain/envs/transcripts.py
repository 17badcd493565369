"""Synthetic transcripts for the built-in environments (calculator, word_problems, guess_number): SFT cold starts
for agentic RL.

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
come from the task's training draws (never its held-out problems). A word problem's transcript makes one
`calculate` call per operation, each on the previous call's result (`--operations 2`: only two-step problems,
a cold start that shows the format but not the longer chains).

    python -m posttrain.envs.transcripts --out calculator_sft.jsonl --rows 2000 --seed 0
    python -m posttrain.envs.transcripts --env word_problems --out wp_sft.jsonl --rows 8 --operations 2
    python -m posttrain.envs.transcripts --env word_problems --out wp_sft.jsonl --rows 24 --operations 2 3 4

A guess_number transcript is a game played by a player who follows the rules but not the strategy: each guess
is drawn uniformly from the range the answers so far allow (`--show-range`: the environment states that range
in each answer), so the cold start learns the format and to stay in range, and RL is left to find that the
middle of the range wins (51% of 1..100 games within 7 guesses for the random player, 100% for bisection):

    python -m posttrain.envs.transcripts --env guess_number --out gn_sft.jsonl --rows 64 --max-turns 7 --show-range

`--env guess_number_tools` writes the same players' games in the tool form (each guess a `guess` tool call, the
form TRL's GRPOTrainer plays; posttrain/envs/guess_number_tools.py), ending with a turn without a call:

    python -m posttrain.envs.transcripts --env guess_number_tools --out gnt_sft.jsonl --rows 64 --show-range
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.envs import guess_number_tools, word_problems
from posttrain.envs.builtin_tools import calculate, calculator
from posttrain.envs.calculator import FINAL_ANSWER, SYSTEM_PROMPT
from posttrain.envs.environment import Message
from posttrain.envs.guess_number import BISECTION_TURNS, GuessNumberEnvironment
from posttrain.envs.guess_number_tools import GuessNumberGame
from posttrain.envs.tools import Tool, as_tool, run_tool_call
from posttrain.envs.trl_adapter import trl_environment_factory
from posttrain.envs.turns import ParsedTurn, ToolCall
from posttrain.tasks.guess_number import GuessNumberTask
from posttrain.tasks.multiplication import MultiplicationTask
from posttrain.tasks.word_problems import MAX_OPERATIONS, MIN_OPERATIONS, WordProblemsTask, running_values

GAME_TURNS = BISECTION_TURNS  # guess_number's budget in the demo's games

_OPERANDS = re.compile(r"(\d+)\D+(\d+)")


def solved_episode(
    row: dict[str, Any], system_prompt: str, tool: Tool, expressions: list[str], answer: str
) -> dict[str, Any]:
    """The conversation of a model that calls `tool` once per expression (results from the real tool) and then
    answers; `answer` is the task's reference, which the last result must equal."""
    messages: list[Message] = [{"role": "system", "content": system_prompt}, *row["prompt"]]
    result: Message = {"content": ""}
    for index, expression in enumerate(expressions):
        call = ToolCall(name=tool.name, arguments={"expression": expression}, id=f"call_{index}")
        result, _ = run_tool_call({tool.name: tool}, call)
        messages += [ParsedTurn(text="", content="", tool_calls=[call]).as_message(), result]
    if result["content"] != answer:
        raise AssertionError(f"the tool said {result['content']} for {expressions}, the task says {answer}")
    messages.append({"role": "assistant", "content": FINAL_ANSWER.format(answer=answer)})
    return {"messages": messages, "tools": [tool.schema]}


def calculator_transcript(row: dict[str, Any], system_prompt: str = SYSTEM_PROMPT) -> dict[str, Any]:
    """The solved episode of one multiplication row (see the module docstring)."""
    question = row["prompt"][-1]["content"]
    a, b = _OPERANDS.search(question).groups()  # type: ignore[union-attr]  # the task's prompts hold both numbers
    return solved_episode(row, system_prompt, as_tool(calculator), [f"{a} * {b}"], row["answer"])


def word_problem_transcript(row: dict[str, Any], system_prompt: str = word_problems.SYSTEM_PROMPT) -> dict[str, Any]:
    """The solved episode of one word problem: one `calculate` call per operation, on the running result."""
    chain = [(op, n) for op, n in row["chain"]]
    inputs = [row["start"], *running_values(row["start"], chain)]  # each call's left operand: the previous result
    expressions = [f"{value} {op} {n}" for value, (op, n) in zip(inputs, chain)]
    return solved_episode(row, system_prompt, as_tool(calculate), expressions, row["answer"])


def calculator_transcripts(rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """`rows` solved episodes over fresh training problems of the multiplication task drawn from `seed`."""
    return [calculator_transcript(row) for row in MultiplicationTask(seed=seed).sample(rows)]


def word_problem_transcripts(
    rows: int, seed: int = 0, operations: int | Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """`rows` solved episodes over training word problems from `seed`; `operations`: only problems of that many
    steps, or of each of several counts (rows split evenly, count k drawn from seed + k, then interleaved:
    2, 3, 4, 2, 3, 4, ... so that every SFT batch mixes the lengths)."""
    if operations is None or isinstance(operations, int):
        task, picked = WordProblemsTask(seed=seed), []
        while len(picked) < rows:
            picked += [row for row in task.sample(rows) if operations is None or row["operations"] == operations]
        return [word_problem_transcript(row) for row in picked[:rows]]
    counts = list(operations)
    if not counts or rows % len(counts):
        raise ValueError(f"{rows} rows do not split evenly over the operation counts {counts}")
    per_count = [word_problem_transcripts(rows // len(counts), seed + k, k) for k in counts]
    return [record for group in zip(*per_count) for record in group]


def guess_number_transcripts(
    rows: int, seed: int = 0, max_turns: int = GAME_TURNS, show_range: bool = False
) -> list[dict[str, Any]]:
    """`rows` games over training secrets from `seed`, each guess uniform within the range the answers allow (see
    the module docstring); a game ends with the player's last guess, won or not."""
    rng = random.Random(f"guess_number-player:{seed}")
    records = []
    for row in GuessNumberTask(seed=seed).sample(rows):
        env = GuessNumberEnvironment(max_turns, show_range=show_range)
        messages = env.reset(row)
        while True:
            guess = str(rng.randint(env.game.low, env.game.high))
            messages.append({"role": "assistant", "content": guess})
            step = env.step(ParsedTurn(text=guess, content=guess))
            if step.done:
                break
            messages += step.observations
        records.append({"messages": messages})
    return records


def guess_number_tool_transcripts(
    rows: int, seed: int = 0, max_turns: int = GAME_TURNS, show_range: bool = False
) -> list[dict[str, Any]]:
    """The same players' games in the tool form (posttrain/envs/guess_number_tools.py): each guess a `guess`
    call, answered by the game's own tool through the TRL adapter, then a last turn without a call (the number
    when found, else that the guesses ran out), where TRL's convention ends an episode."""
    rng = random.Random(f"guess_number-player:{seed}")
    make = trl_environment_factory(
        GuessNumberGame, system_prompt=guess_number_tools.SYSTEM_PROMPT, max_turns=max_turns, show_range=show_range
    )
    records = []
    for row in GuessNumberTask(seed=seed).sample(rows):
        env = make()
        game = env.environment.game
        messages = env.reset(row)
        while not game.over:
            number = rng.randint(game.low, game.high)
            call = ToolCall(name="guess", arguments={"number": number}, id=f"call_{game.guesses}")
            turn = ParsedTurn(text="", content="", tool_calls=[call])
            messages += [turn.as_message(), *env.step(turn).observations]
        final = f"The number is {game.secret}." if game.solved else "I ran out of guesses."
        messages.append({"role": "assistant", "content": final})
        records.append({"messages": messages, "tools": [tool.schema for tool in env.tools]})
    return records


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m posttrain.envs.transcripts", description="Write tool-use SFT transcripts (JSONL)."
    )
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--rows", type=int, default=1000, help="how many transcripts (default: 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed (default: 0)")
    parser.add_argument(
        "--env",
        choices=("calculator", "word_problems", "guess_number", "guess_number_tools"),
        default="calculator",
        help="whose episodes",
    )
    parser.add_argument(
        "--operations",
        type=int,
        nargs="+",
        default=None,
        help="word_problems: only problems of this many steps; several counts split --rows evenly between them",
    )
    parser.add_argument(
        "--max-turns", type=int, help=f"guess_number(_tools): the game's budget (default: {GAME_TURNS})"
    )
    parser.add_argument(
        "--show-range", action="store_true", help="guess_number(_tools): each answer states the range still possible"
    )
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be positive, got {args.rows}")
    if args.operations is not None:
        if args.env != "word_problems":
            parser.error("--operations applies to --env word_problems")
        for count in args.operations:
            if not MIN_OPERATIONS <= count <= MAX_OPERATIONS:
                parser.error(f"--operations must be {MIN_OPERATIONS} to {MAX_OPERATIONS}, got {count}")
        if len(set(args.operations)) != len(args.operations) or args.rows % len(args.operations):
            parser.error(f"--rows {args.rows} must split evenly over distinct --operations {args.operations}")
        args.operations = args.operations[0] if len(args.operations) == 1 else args.operations
    if not args.env.startswith("guess_number") and (args.show_range or args.max_turns is not None):
        parser.error("--max-turns and --show-range apply to --env guess_number and guess_number_tools")
    if args.max_turns is None:
        args.max_turns = GAME_TURNS
    if args.max_turns < 1:
        parser.error(f"--max-turns must be positive, got {args.max_turns}")
    if args.env == "calculator":
        records = calculator_transcripts(args.rows, args.seed)
    elif args.env == "guess_number":
        records = guess_number_transcripts(args.rows, args.seed, args.max_turns, args.show_range)
    elif args.env == "guess_number_tools":
        records = guess_number_tool_transcripts(args.rows, args.seed, args.max_turns, args.show_range)
    else:
        records = word_problem_transcripts(args.rows, args.seed, args.operations)
    path = write_jsonl(args.out, records)
    print(f"wrote {args.rows} transcripts to {path}")


if __name__ == "__main__":
    main()

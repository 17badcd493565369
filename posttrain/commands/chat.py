"""`posttrain chat`: an interactive chat that streams the model's reply as it is generated.

Lines starting with `/` are commands: /reset (forget the conversation), /system TEXT, /exit.
Reads standard input, so it also runs piped (`echo hi | posttrain chat`).
"""

from __future__ import annotations

import argparse
import sys

from posttrain.commands.common import add_model_arguments
from posttrain.commands.sampling_args import add_sampling_arguments, engine_kwargs, sampling_params_from_args

HELP = "commands: /reset  /system TEXT  /exit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(parser, default_temperature=0.7)


def run(args: argparse.Namespace) -> int:
    from posttrain.engine.llm import LLM

    params = sampling_params_from_args(args)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, **engine_kwargs(args))
    system = args.system
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"posttrain chat with {args.model} ({HELP})")
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command == "/exit":
                return 0
            if command == "/reset":
                history.clear()
            elif command == "/system":
                system, history = rest or None, []
            else:
                print(HELP)
            continue
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        reply = []
        for delta in llm.stream(messages, params):
            reply.append(delta.text)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})

"""`posttrain chat`: an interactive chat that streams the model's reply as it is generated.

Lines starting with `/` are commands: /reset (forget the conversation), /system TEXT, /exit.
Reads standard input, so it also runs piped (`echo hi | posttrain chat`). A line that is not UTF-8, or a
message the model cannot take (longer than its context), is reported on stderr and the session goes on.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.commands.common import add_model_arguments, add_quant_argument
from posttrain.commands.sampling_args import add_sampling_arguments, engine_kwargs, sampling_params_from_args
from posttrain.commands.speculative_args import add_speculative_arguments
from posttrain.commands.text_input import at, check_argument, decode_line
from posttrain.errors import PosttrainError

HELP = "commands: /reset  /system TEXT  /exit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_quant_argument(parser)
    parser.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(parser, default_temperature=0.7)
    add_speculative_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from posttrain.engine.llm import LLM

    params = sampling_params_from_args(args)
    system = None if args.system is None else check_argument(args.system, "--system")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quant=args.quant, **engine_kwargs(args))
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    # Bytes, decoded here: a text stdin would either raise on a bad byte (a UTF-8 locale) or pass it on
    # as a lone surrogate the tokenizer refuses (C locale). A bad line is reported and skipped.
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    if interactive:
        print(f"posttrain chat with {args.model} ({HELP})")
    line_no = 0
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        raw = stdin.readline()
        if not raw:
            return 0
        line_no += 1
        line, problem = decode_line(raw, first_line=line_no == 1)
        if problem is not None:
            _report(at(f"<stdin>:{line_no}", problem) + "; the line is skipped")
            continue
        text = line.rstrip("\r\n")
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
        reply: list[str] = []
        try:
            for delta in llm.stream(messages, params):
                reply.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        except PosttrainError as exc:  # this message cannot be answered (too long for the context, ...)
            history.pop()  # the conversation goes on as if it had not been sent
            if reply:
                sys.stdout.write("\n")
            _report(f"{exc}; the message is dropped, the conversation goes on (/reset starts a new one)")
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def _report(message: str) -> None:
    sys.stdout.flush()  # keep the order of the replies and the errors on a terminal
    print(f"error: {message}", file=sys.stderr, flush=True)

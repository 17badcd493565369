"""`posttrain <command> ...`: thin dispatch. Each command lives in `posttrain.commands.<name>` and has
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs."""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
from collections.abc import Sequence

from posttrain.errors import PosttrainError

# command -> one-line help; the command runs from `command_module(command)`
COMMANDS: dict[str, str] = {
    "generate": "generate text from prompts with the rollout engine",
    "chat": "interactive chat with a model, streaming tokens",
    "info": "architecture, parameter count, dtype and memory of a model",
    "convert": "convert a model (GGUF, HF dir, known name) to an HF directory",
    "quantize": "write an int8 / int4 quantized model directory",
    "eval": "evaluate a model: perplexity, task accuracy / pass@k, EM / F1, preference accuracy",
    "sft": "supervised fine-tuning on prompt/completion, chat or text data",
    "lora-merge": "merge a PEFT LoRA adapter into its base model and save an HF directory",
    "grpo": "RL with the GRPO family (grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp)",
    "ppo": "RL with PPO (GAE, a value head on the policy trunk)",
    "dpo": "preference optimisation: dpo (sigmoid), cdpo, robust, hinge, ipo, simpo, orpo, kto",
    "rm": "train a reward model (Bradley-Terry, scalar head) for the RL model reward",
    "distill": "distill a teacher into a student (forward / reverse KL, JSD; off- or on-policy)",
    "serve": "an OpenAI-compatible HTTP server (completions, chat, streaming) over the engine",
    "estimate": "memory per device and time per step of a training setup, from the shapes alone",
    "report": "render a run directory's metrics.jsonl as report.html with plots",
}


def command_module(name: str) -> str:
    """The module of command `name`: posttrain.commands.<name>, with `-` written `_` (lora-merge: lora_merge)."""
    return f"posttrain.commands.{name.replace('-', '_')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Post-training for decoder-only LLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    global _left_process_groups
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
        parser.parse_args(argv)
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    module = importlib.import_module(command_module(name))
    sub = argparse.ArgumentParser(prog=f"posttrain {name}", description=COMMANDS[name])
    module.add_arguments(sub)
    args, unknown = sub.parse_known_args(argv[1:])
    if unknown:
        if not isinstance(getattr(args, "argv", None), list):
            sub.error(f"unrecognized arguments: {' '.join(unknown)}")
        # A REMAINDER positional (the config commands' overrides) gets only what follows the first positional
        # string: options before it (`posttrain dpo --loss kto data.path=x`) come back unknown, in order.
        args.argv = unknown + args.argv
    try:
        if hasattr(args, "nproc"):  # a trainer with a dist: section
            from posttrain.distributed.launch import relaunch, split_nproc

            nproc, args.argv = split_nproc(args.argv)  # `--nproc` after the config lands among the overrides
            nproc = args.nproc if nproc is None else nproc
            if nproc is not None:
                return relaunch(nproc, argv)
        code = int(module.run(args) or 0)
        _left_process_groups = _leave_process_groups()
        return code
    except PosttrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_left_process_groups = False  # main() destroyed the process groups of a command that ran to its end


def _leave_process_groups() -> bool:
    """After a command ran to its end under torchrun: destroy the process groups while the interpreter is whole
    (True where there were some). Not on an error path: a group with an operation still posted to a rank that is
    gone would wait for it."""
    if "torch.distributed" not in sys.modules:  # a command that never imported it (info, convert) has no group
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def program(argv: Sequence[str] | None = None) -> None:
    """The `posttrain` program (the console script, `python -m posttrain`, what torchrun starts): main(argv), then
    exit with its code. A wrapper module that torchrun starts in posttrain's place (tests/distributed) ends with
    this too, not with sys.exit(main(...)).

    A torchrun rank whose command ran to its end exits without the interpreter's and the C++ runtime's teardown
    (os._exit after Python's exit handlers and a flush of the standard streams). Why: in that teardown gloo's
    threads may abort the rank ("terminate called without an active exception", SIGABRT) after a run whose work
    all landed, even with the groups destroyed first, and torchrun then fails the whole run. Everything the run
    writes is closed by then (checkpoints, metrics, trackers); only that teardown is skipped."""
    code = main(argv)
    if _left_process_groups:
        atexit._run_exitfuncs()  # logging's shutdown, a tracker library's own handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    program()

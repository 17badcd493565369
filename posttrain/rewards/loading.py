"""Reward specs -> reward functions: built-in names, `name:argument` factories, or `file.py:function`.

    numeric_match | gsm8k | boxed                         plain functions
    format:<regex>                                         format_reward(regex) (fullmatch)
    think_format                                           format_reward(THINK_ANSWER_PATTERN)
    length_penalty:max_len=256[,penalty_factor=0.5]        length_penalty(...)
    overlong_penalty:max_len=256,cache_len=64              overlong_penalty(...)
    reward_model:<dir>                                     RewardModelScorer(<dir>)
    code_tests[:cpu_seconds=5,memory_mb=512,...]           code_reward(...): run the code against `tests`
    path/to/file.py:function                               that function, imported from the file

Keyword options given to `load_reward` go to the factory, after the ones in the spec string.
`load_reward_specs` loads the functions a run scores with (the RL trainers' and `posttrain eval accuracy`'s),
as weighted `RewardSpec`s checked against the data's columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.imports import FileImportError, import_file
from posttrain.rewards.answers import boxed, gsm8k, numeric_match
from posttrain.rewards.base import RewardError, RewardFn
from posttrain.rewards.code import code_reward
from posttrain.rewards.combine import RewardSpec
from posttrain.rewards.format import THINK_ANSWER_PATTERN, format_reward
from posttrain.rewards.length import COMPLETION_IDS_COLUMN, length_penalty, overlong_penalty
from posttrain.rewards.signature import check_reward_signature


@dataclass(frozen=True)
class Builtin:
    """One built-in reward. `make(argument, options)` builds the function; `argument` says what may follow
    the name after ':' — "none", "text" (taken verbatim, e.g. a regex or a path) or "options" (k=v,k=v)."""

    make: Callable[[str | None, dict[str, Any]], RewardFn]
    argument: str
    usage: str


def _plain(fn: RewardFn) -> Callable[[str | None, dict[str, Any]], RewardFn]:
    def make(argument: str | None, options: dict[str, Any]) -> RewardFn:
        if options:
            raise RewardError(f"reward {fn.__name__!r} takes no options, got {', '.join(options)}")
        return fn

    return make


def _factory(factory: Callable[..., RewardFn], name: str) -> Callable[[str | None, dict[str, Any]], RewardFn]:
    def make(argument: str | None, options: dict[str, Any]) -> RewardFn:
        args = () if argument is None else (argument,)
        try:
            return factory(*args, **options)
        except TypeError as error:  # unknown or missing option
            raise RewardError(f"reward {name!r}: {error} (usage: {BUILTINS[name].usage})") from None

    return make


def _reward_model(path: str, **options: Any) -> RewardFn:
    from posttrain.rewards.model_reward import RewardModelScorer

    try:
        return RewardModelScorer(path, **options)
    except PosttrainError as error:  # a checkpoint problem, reported as this spec's problem
        raise RewardError(f"reward 'reward_model:{path}': {error}") from error


BUILTINS: dict[str, Builtin] = {
    "numeric_match": Builtin(_plain(numeric_match), "none", "numeric_match"),
    "gsm8k": Builtin(_plain(gsm8k), "none", "gsm8k"),
    "boxed": Builtin(_plain(boxed), "none", "boxed"),
    "format": Builtin(_factory(format_reward, "format"), "text", "format:<regex>"),
    "think_format": Builtin(
        lambda argument, options: _factory(format_reward, "think_format")(THINK_ANSWER_PATTERN, options),
        "none",
        "think_format",
    ),
    "length_penalty": Builtin(
        _factory(length_penalty, "length_penalty"), "options", "length_penalty:max_len=<int>[,penalty_factor=<float>]"
    ),
    "overlong_penalty": Builtin(
        _factory(overlong_penalty, "overlong_penalty"),
        "options",
        "overlong_penalty:max_len=<int>,cache_len=<int>[,penalty_factor=<float>]",
    ),
    "reward_model": Builtin(_factory(_reward_model, "reward_model"), "text", "reward_model:<model dir>"),
    "code_tests": Builtin(
        _factory(code_reward, "code_tests"),
        "options",
        "code_tests[:cpu_seconds=<s>,wall_seconds=<s>,memory_mb=<MiB>,file_mb=<MiB>,max_processes=<n>,max_workers=<n>]",
    ),
}


def load_reward(spec: str, **options: Any) -> RewardFn:
    """A reward function from a spec string (see the module docstring); its signature is checked here.

    Errors (RewardError) name the spec: unknown built-in, bad option, file missing, import failure,
    no such function, not callable, or a signature that cannot take (prompts, completions, **columns).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"a reward spec must be a non-empty string, got {spec!r}")
    name, sep, argument = spec.partition(":")
    if name in BUILTINS:
        fn = _load_builtin(spec, name, argument if sep else None, options)
    else:
        file_part, sep, function_name = spec.rpartition(":")
        if not sep or not file_part.endswith(".py"):
            raise RewardError(
                f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTINS)}) or path/to/file.py:function"
            )
        if options:
            raise RewardError(f"reward {spec!r}: options ({', '.join(options)}) apply to built-ins only")
        fn = load_reward_from_file(Path(file_part), function_name)
    check_reward_signature(fn, spec)
    return fn


def load_reward_specs(
    specs: Sequence[str], columns: Sequence[str], weights: Sequence[float] | None = None
) -> list[RewardSpec]:
    """One `RewardSpec` per spec string, named by the spec, with its weight in the total (`weights`, one per
    spec; None: 1 each). Each function's signature is checked against what it will be called with: the rows'
    `columns` (every key but the prompt) plus `completion_ids`, so a bad spec fails before any generation.
    The caller handles an empty `specs` with its own message (it knows which option names the functions)."""
    if not specs:
        raise RewardError("no reward function to load")
    if weights is not None and len(weights) != len(specs):
        raise RewardError(f"{len(weights)} reward weights for {len(specs)} reward functions")
    received = [*columns, COMPLETION_IDS_COLUMN]
    loaded = []
    for spec, weight in zip(specs, weights if weights is not None else [1.0] * len(specs)):
        fn = load_reward(spec)
        check_reward_signature(fn, spec, received)
        loaded.append(RewardSpec(spec, fn, weight))
    return loaded


def _load_builtin(spec: str, name: str, argument: str | None, options: dict[str, Any]) -> RewardFn:
    builtin = BUILTINS[name]
    if builtin.argument == "none" and argument is not None:
        raise RewardError(f"reward {spec!r}: {name!r} takes nothing after ':' (usage: {builtin.usage})")
    if builtin.argument == "text" and not argument:
        raise RewardError(f"reward {spec!r}: {name!r} needs an argument (usage: {builtin.usage})")
    if builtin.argument == "options":
        options = {**parse_options(argument or "", spec), **options}
        argument = None
    return builtin.make(argument, options)


def parse_options(text: str, spec: str) -> dict[str, Any]:
    """'max_len=256,penalty_factor=0.5' -> {'max_len': 256, 'penalty_factor': 0.5} (ints, floats, else strings)."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise RewardError(f"reward {spec!r}: option {item!r} is not key=value")
        options[key.strip()] = _option_value(value.strip())
    return options


def _option_value(text: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def load_reward_from_file(path: Path, function_name: str) -> RewardFn:
    """`function_name` from the Python file at `path` (relative paths are from the working directory).

    The file is imported once per process under a private module name (registered in sys.modules so
    dataclasses and pickling inside it work); a second load of the same file reuses that module.
    """
    path = path.expanduser()
    if not path.is_file():
        raise RewardError(f"reward file {path} not found (spec {str(path)}:{function_name})")
    if not function_name.isidentifier():
        raise RewardError(f"reward file {path}: {function_name!r} is not a function name (spec path.py:function)")
    module = _import_file(path.resolve())
    if not hasattr(module, function_name):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RewardError(
            f"reward file {path}: no function {function_name!r} "
            f"(it defines: {', '.join(defined) or 'no public functions'})"
        )
    fn = getattr(module, function_name)
    if not callable(fn):
        raise RewardError(f"reward file {path}: {function_name!r} is a {type(fn).__name__}, not a callable")
    return fn


def _import_file(path: Path) -> ModuleType:
    try:
        return import_file(path, "posttrain_reward")
    except FileImportError as error:
        raise RewardError(f"reward file {path}: {error}") from error.__cause__

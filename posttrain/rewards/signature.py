"""The calling-convention check, run before any compute.

A reward function is called with keywords only, as TRL calls it:
`fn(prompts=..., completions=..., **columns)`. It can take that call when

1. every parameter without a default can be passed by keyword (no positional-only ones) and is
   named `prompts`, `completions` or one of the columns (when the columns are known), and
2. it has a `**kwargs` parameter, or it names every keyword it will receive (`prompts`,
   `completions` and every column) as a parameter.

Before the columns are known (`columns=None`, e.g. when a config is loaded) a required parameter other
than `prompts` / `completions` is taken for a column; the trainer checks again with the dataset's
column names before its first rollout, and `compute_rewards` checks before calling any function.

So `def f(completions, answer, **kwargs)` (TRL style) is fine; `def f(p, c)`, `def f(completions)`
and, for a dataset without a `solution` column, `def f(prompts, completions, solution, **kwargs)`
are refused with a message that says which parameter is the problem. `*args` receives nothing.
Callables whose signature Python cannot inspect (some C builtins) are accepted unchecked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from posttrain.rewards.base import RewardError

FIXED_ARGUMENTS = ("prompts", "completions")


def describe_callable(fn: Any) -> str:
    """`module.qualname (file:line)` for a function, the class name for other callables."""
    target = inspect.unwrap(fn) if inspect.isfunction(fn) or inspect.ismethod(fn) else fn
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    code = getattr(target, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{module}.{name}{where}" if module else f"{name}{where}"


def check_reward_signature(fn: Callable[..., Any], name: str, columns: Iterable[str] | None = None) -> None:
    """Raise RewardError (one message naming the reward and the parameter) if `fn` cannot be called as
    `fn(prompts=..., completions=..., **columns)`. With `columns` None only the fixed arguments are
    checked (the columns are not known yet, e.g. at config load); pass the dataset's column names (and
    `completion_ids` if the trainer adds it) to check them too. See the module docstring for the rule."""
    if not callable(fn):
        raise RewardError(f"reward {name!r}: {type(fn).__name__} object is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    column_names = None if columns is None else list(columns)
    received = list(FIXED_ARGUMENTS) + (column_names or [])
    prefix = f"reward {name!r} ({describe_callable(fn)}) cannot be called as fn(prompts, completions, **columns)"
    params = signature.parameters.values()
    has_var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    keyword_names = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    for param in params:
        required = param.default is inspect.Parameter.empty
        if param.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            raise RewardError(
                f"{prefix}: parameter {param.name!r} is positional-only, but reward functions are "
                f"called with keywords (prompts=, completions=, <column>=)"
            )
        if param.name in keyword_names and required and param.name not in received:
            if column_names is None:
                continue  # taken for a column; checked once the columns are known
            raise RewardError(
                f"{prefix}: required parameter {param.name!r} is not one of the arguments it gets "
                f"({', '.join(received)}); rename it, give it a default, or add a column {param.name!r}"
            )
    if not has_var_keyword:
        unaccepted = [key for key in received if key not in keyword_names]
        if unaccepted:
            raise RewardError(
                f"{prefix}: it has no **kwargs and no parameter for {', '.join(map(repr, unaccepted))}; "
                f"add **kwargs to its signature"
            )

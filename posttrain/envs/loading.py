"""Environment specs -> a factory of environments (one environment per episode).

    calculator                      multiplication with the calculator tool, exact-answer reward (calculator.py)
    guess_number                    higher / lower guessing within a turn budget (guess_number.py)
    word_problems                   chained word problems, one calculator step per call (word_problems.py)
    tools                           the generic ToolEnvironment over `tools` (tool_env.py)
    path/to/file.py:Class           a class of the user's, from a file or
    package.module:Class            a module: a posttrain Environment (reset / step / episode_reward) or a
                                    TRL environment_factory class (reset, tool methods, get_reward), detected;
                                    posttrain.envs.guess_number_tools:GuessNumberGame is one (guess_number as a tool)

`tools` entries are built-in tool names (calculator, calculate, python) or `path.py:function` / `module:function`; they
are the generic environment's tools, or tools added to a TRL environment's methods. `options` go to the
environment's constructor (e.g. {"max_turns": 6} for guess_number, {"system_prompt": ...}). Everything is
checked here, before any compute; errors name the spec.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from posttrain.envs.builtin_tools import BUILTIN_TOOLS
from posttrain.envs.calculator import calculator_environment
from posttrain.envs.environment import EnvError, Environment
from posttrain.envs.guess_number import GuessNumberEnvironment
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import Tool, as_tools
from posttrain.envs.trl_adapter import is_trl_environment_class, trl_environment_factory
from posttrain.envs.word_problems import WordProblemsEnvironment
from posttrain.imports import is_import_spec, load_object

EnvironmentFactory = Callable[[], Environment]

BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "calculator": calculator_environment,
    "guess_number": GuessNumberEnvironment,
    "tools": ToolEnvironment,
    "word_problems": WordProblemsEnvironment,
}
_TAKES_TOOLS = {"tools"}  # built-ins whose tools come from the `tools` list


def load_tools(specs: Iterable[str | Callable[..., Any]]) -> list[Tool]:
    """Tools from built-in names, `file.py:function` / `module:function` specs, or functions."""
    functions = []
    for spec in specs:
        if callable(spec):
            functions.append(spec)
        elif isinstance(spec, str) and spec in BUILTIN_TOOLS:
            functions.append(BUILTIN_TOOLS[spec])
        elif isinstance(spec, str) and is_import_spec(spec):
            functions.append(load_object(spec, "tool", EnvError))
        else:
            raise EnvError(
                f"unknown tool {spec!r} (built-ins: {', '.join(BUILTIN_TOOLS)}; or path/to/file.py:function "
                "or package.module:function)"
            )
    return as_tools(functions)


def load_environment_factory(
    name: str, tools: Iterable[str | Callable[..., Any]] = (), options: Mapping[str, Any] | None = None
) -> EnvironmentFactory:
    """A factory of fresh environments for `name` (see the module docstring); one episode per environment."""
    options = dict(options or {})
    loaded_tools = load_tools(tools)
    if name in BUILTIN_ENVIRONMENTS:
        constructor = BUILTIN_ENVIRONMENTS[name]
        if name in _TAKES_TOOLS:
            if not loaded_tools:
                raise EnvError(
                    f"environment {name!r}: give the tools it offers (built-ins: {', '.join(BUILTIN_TOOLS)})"
                )
            options["tools"] = loaded_tools
        elif loaded_tools:
            raise EnvError(f"environment {name!r} has its own tools; tools= applies to 'tools' and TRL environments")
        return _checked_factory(name, constructor, options)
    if not isinstance(name, str) or not is_import_spec(name):
        raise EnvError(
            f"unknown environment {name!r} (built-ins: {', '.join(BUILTIN_ENVIRONMENTS)}; or path/to/file.py:Class "
            "or package.module:Class)"
        )
    cls = load_object(name, "environment", EnvError)
    if not isinstance(cls, type):
        raise EnvError(f"environment {name!r} is a {type(cls).__name__}, not a class")
    if is_trl_environment_class(cls):
        try:
            return trl_environment_factory(cls, loaded_tools, **options)
        except EnvError as error:
            raise EnvError(f"environment {name!r}: {error}") from None
    missing = [method for method in ("reset", "step", "episode_reward") if not callable(getattr(cls, method, None))]
    if missing:
        raise EnvError(
            f"environment {name!r}: {cls.__name__} has no {', '.join(missing)} (a posttrain Environment has reset, "
            "step and episode_reward; a TRL environment has reset and tool methods)"
        )
    if loaded_tools:
        raise EnvError(f"environment {name!r}: tools= applies to 'tools' and TRL environments, not to {cls.__name__}")
    return _checked_factory(name, cls, options)


def _checked_factory(name: str, constructor: Callable[..., Environment], options: dict[str, Any]) -> EnvironmentFactory:
    """`constructor(**options)` as a factory, after checking the options bind and one environment can be built
    (a bad value fails here, named, not in a rollout worker)."""
    try:
        inspect.signature(constructor).bind(**options)
    except TypeError as error:
        accepted = ", ".join(p for p in inspect.signature(constructor).parameters if p != "tools") or "none"
        raise EnvError(f"environment {name!r}: {error} (options: {accepted})") from None
    try:
        constructor(**options)
    except EnvError as error:
        raise EnvError(f"environment {name!r}: {error}") from None

    def make() -> Environment:
        return constructor(**options)

    return make

"""TRL's agent conventions, run unchanged: `GRPOTrainer(tools=[...])` and `environment_factory=Class`.

TRL (GRPOTrainer docs, trl >= 1.0) defines an environment as a class whose instance
- has `reset(**row)`: called with the dataset row's columns as keyword arguments before generation; it
  returns None, or a string that is appended to the last user message of the prompt;
- exposes its tools as public methods (every function on the class whose name does not start with "_",
  except `reset` and `get_reward`), each with type hints and a docstring, sync or async;
- may have `get_reward()` (no argument, a float; may be async): the environment owns the episode's reward.
TRL ends an episode at the first turn without tool calls, turns a tool's result into its `str()`, and
passes the environment instances to reward functions as the `environments=` keyword argument.

`TRLEnvironment` wraps one such instance as a posttrain `Environment`; `check_trl_environment_class`
validates the class before any compute (a missing `reset`, a `reset` that cannot take the row's columns
as keywords, a tool method without hints or docstring, a `get_reward` that needs arguments), each failure
one line naming the class and the method. A `reset` without `**kwargs` receives only the columns it names.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from posttrain.envs.environment import EnvError, EnvStep, Message
from posttrain.envs.tool_env import opening_messages, run_tool_calls
from posttrain.envs.tools import DEFAULT_TOOL_TIMEOUT_S, Tool, as_tool, as_tools, run_coroutine
from posttrain.envs.turns import ParsedTurn

RESERVED_METHODS = ("reset", "get_reward")


def is_trl_environment_class(cls: type) -> bool:
    """A class written to TRL's convention: it has `reset` but no posttrain `step` / `episode_reward`."""
    return callable(getattr(cls, "reset", None)) and not (hasattr(cls, "step") and hasattr(cls, "episode_reward"))


def tool_method_names(cls: type) -> list[str]:
    """The class's tool methods as TRL finds them: public functions other than reset / get_reward."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in RESERVED_METHODS
    ]


def check_trl_environment_class(cls: type) -> dict[str, dict[str, Any]]:
    """Validate a TRL environment class; returns each tool method's schema (computed once, without an instance)."""
    name = getattr(cls, "__name__", repr(cls))
    if not isinstance(cls, type):
        raise EnvError(f"TRL environment {name}: expected a class, got a {type(cls).__name__}")
    reset = inspect.getattr_static(cls, "reset", None)
    if not inspect.isfunction(reset):
        raise EnvError(f"TRL environment {name}: no reset method (TRL calls reset(**row) before each episode)")
    bad = [
        p.name
        for p in list(inspect.signature(reset).parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)
    ]
    if bad:
        raise EnvError(
            f"TRL environment {name}.reset: takes {', '.join(bad)} by position; TRL passes the row's columns "
            "as keyword arguments (def reset(self, **kwargs))"
        )
    get_reward = inspect.getattr_static(cls, "get_reward", None)
    if get_reward is not None:
        required = [
            p.name
            for p in list(inspect.signature(get_reward).parameters.values())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            raise EnvError(
                f"TRL environment {name}.get_reward: must take no arguments, it requires {', '.join(required)}"
            )
    schemas = {}
    for method in tool_method_names(cls):
        # bound to a placeholder: the schema is the method's without `self`, and no instance is made here
        probe = types.MethodType(getattr(cls, method), object())
        schemas[method] = as_tool(probe, where=f"{name}.{method}").schema  # ToolError: "tool Class.method: ..."
    return schemas


def _stringified(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with its result turned into `str()` as TRL does (a tool may return a number or a dict)."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def call_async(**arguments: Any) -> str:
            return _as_text(await method(**arguments))

        return call_async

    @functools.wraps(method)
    def call(**arguments: Any) -> str:
        return _as_text(method(**arguments))

    return call


def _as_text(result: Any) -> str:
    return result if isinstance(result, str) else str(result)


class TRLEnvironment:
    """One episode of a TRL environment instance (see the module docstring). `environment` is the user's
    instance: what TRL's reward functions receive, one per episode, as `environments=`."""

    def __init__(
        self,
        environment: Any,
        schemas: Mapping[str, dict[str, Any]],
        extra_tools: Iterable[Callable[..., Any] | Tool] = (),
        system_prompt: str | None = None,
        tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    ) -> None:
        self.environment = environment
        methods = [
            Tool(
                name,
                _stringified(getattr(environment, name)),
                schema,
                inspect.iscoroutinefunction(getattr(environment, name)),
            )
            for name, schema in schemas.items()
        ]
        self.tools = as_tools([*as_tools(extra_tools), *methods])
        self.tools_by_name = {tool.name: tool for tool in self.tools}
        self.system_prompt = system_prompt
        self.tool_timeout_s = tool_timeout_s

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        messages = opening_messages(row, self.system_prompt)
        observation = _call(self.environment.reset, **_reset_arguments(self.environment.reset, row))
        if observation is not None:
            if not isinstance(observation, str):
                name = type(self.environment).__name__
                raise EnvError(
                    f"TRL environment {name}.reset: returned a {type(observation).__name__}, not None or a string"
                )
            last = messages[-1]
            messages[-1] = {**last, "content": last["content"] + observation}  # TRL appends it to the last message
        return messages

    def step(self, turn: ParsedTurn) -> EnvStep:
        if not turn.tool_calls and not turn.errors:
            return EnvStep(done=True, counts={"parse_failures": 0.0})
        observations, counts = run_tool_calls(self.tools_by_name, turn, self.tool_timeout_s)
        return EnvStep(observations=observations, counts=counts)

    def episode_reward(self) -> float | None:
        get_reward = getattr(self.environment, "get_reward", None)
        if get_reward is None:
            return None
        reward = _call(get_reward)
        return None if reward is None else float(reward)


def _reset_arguments(reset: Callable[..., Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's columns reset takes: all of them with **kwargs, else those it names (TRL passes all)."""
    parameters = inspect.signature(reset).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return dict(row)
    missing = [n for n, p in parameters.items() if p.default is p.empty and n not in row]
    if missing:
        raise EnvError(f"TRL environment reset: the row has no column {', '.join(map(repr, missing))} it requires")
    return {key: value for key, value in row.items() if key in parameters}


def _call(function: Callable[..., Any], **arguments: Any) -> Any:
    if inspect.iscoroutinefunction(function):
        return run_coroutine(lambda: function(**arguments))
    return function(**arguments)


def trl_environment_factory(
    cls: type,
    extra_tools: Iterable[Callable[..., Any] | Tool] = (),
    system_prompt: str | None = None,
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    **options: Any,
) -> Callable[[], TRLEnvironment]:
    """A factory of `TRLEnvironment`s over fresh `cls(**options)` instances; the class is validated now."""
    schemas = check_trl_environment_class(cls)
    tools = as_tools(extra_tools)
    clashes = sorted({tool.name for tool in tools} & set(schemas))
    if clashes:
        raise EnvError(f"TRL environment {cls.__name__}: tools= and its methods both define {', '.join(clashes)}")
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as error:
        raise EnvError(f"TRL environment {cls.__name__}: {error} (options go to its constructor)") from None
    try:
        cls(**options)  # one instance now, as TRL probes one: a bad option's value fails here, named
    except (EnvError, TypeError, ValueError) as error:
        raise EnvError(f"TRL environment {cls.__name__}: {error}") from None

    def make() -> TRLEnvironment:
        return TRLEnvironment(cls(**options), schemas, tools, system_prompt, tool_timeout_s)

    return make

"""TRL environment_factory classes run unchanged: reset(**row) and its string, tool methods, get_reward;
a class TRL could not use is one clear error naming the class and the method, before any episode."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.envs.environment import EnvError, Environment
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.tools import ToolError
from posttrain.envs.trl_adapter import (
    TRLEnvironment,
    check_trl_environment_class,
    is_trl_environment_class,
    trl_environment_factory,
)

transformers = pytest.importorskip("transformers")


class Counter:
    """A TRL-style environment, as TRL's docs write them."""

    def __init__(self, start: int = 0) -> None:
        self.start = start

    def reset(self, **kwargs) -> str | None:
        self.value = self.start + kwargs.get("offset", 0)
        self.seen = dict(kwargs)
        return f" (the counter is at {self.value})"

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value  # not a string: TRL answers with str() of it

    async def read(self) -> str:
        """Read the counter."""
        await asyncio.sleep(0)
        return f"value={self.value}"

    def _helper(self) -> None:  # private: not a tool
        pass

    def get_reward(self) -> float:
        return 1.0 if self.value == 10 else 0.0


def test_schemas_match_what_trl_renders():
    """TRL passes the instance's bound methods to the chat template; transformers makes their schemas."""
    schemas = check_trl_environment_class(Counter)
    instance = Counter()
    assert set(schemas) == {"increment", "read"}
    for name, schema in schemas.items():
        assert schema == transformers.utils.get_json_schema(getattr(instance, name))


def test_an_episode():
    env = trl_environment_factory(Counter, start=3)()
    assert isinstance(env, Environment) and isinstance(env, TRLEnvironment)
    assert [tool.name for tool in env.tools] == ["increment", "read"]
    messages = env.reset({"prompt": [{"role": "user", "content": "Count to 10."}], "offset": 2})
    assert messages == [{"role": "user", "content": "Count to 10. (the counter is at 5)"}]
    assert env.environment.seen == {"prompt": [{"role": "user", "content": "Count to 10."}], "offset": 2}
    step = env.step(
        parse_hermes(
            '<tool_call>{"name": "increment", "arguments": {"step": 5}}</tool_call>'
            '<tool_call>{"name": "read", "arguments": {}}</tool_call>'
        )
    )
    assert [m["content"] for m in step.observations][0] == "10"  # str() of the int, as TRL does
    assert step.observations[1]["content"] in ("value=5", "value=10")  # concurrent with the increment
    assert env.step(parse_hermes("Done.")).done
    assert env.episode_reward() == 1.0


def test_reset_without_kwargs_gets_the_columns_it_names():
    class Named:
        def reset(self, secret: int, prompt=None) -> None:
            self.secret = secret

        def peek(self) -> str:
            """Peek at the secret."""
            return str(self.secret)

    env = trl_environment_factory(Named)()
    assert env.reset({"prompt": "hi", "secret": 7, "other": 1}) == [{"role": "user", "content": "hi"}]
    assert env.environment.secret == 7
    with pytest.raises(EnvError, match="the row has no column 'secret'"):
        env.reset({"prompt": "hi"})
    assert env.episode_reward() is None  # no get_reward: the run's reward functions score it


def test_bad_classes_are_named_errors():
    class NoReset:
        def tool(self, x: int) -> str:
            """A tool.

            Args:
                x: a number
            """
            return ""

    class NoHints:
        def reset(self, **kwargs) -> None:
            pass

        def search(self, query):
            """Search.

            Args:
                query: what to look for
            """

    class PositionalReset:
        def reset(self, row, /) -> None:
            pass

    class RewardWithArguments:
        def reset(self, **kwargs) -> None:
            pass

        def get_reward(self, completion) -> float:
            return 0.0

    assert not is_trl_environment_class(NoReset)
    with pytest.raises(EnvError, match="TRL environment NoReset: no reset method"):
        check_trl_environment_class(NoReset)
    with pytest.raises(ToolError, match=r"tool NoHints.search: Argument query is missing a type hint"):
        check_trl_environment_class(NoHints)
    with pytest.raises(EnvError, match=r"TRL environment PositionalReset.reset: takes row by position"):
        check_trl_environment_class(PositionalReset)
    with pytest.raises(
        EnvError, match=r"RewardWithArguments.get_reward: must take no arguments, it requires completion"
    ):
        check_trl_environment_class(RewardWithArguments)
    with pytest.raises(EnvError, match=r"TRL environment Counter: .*unexpected keyword argument 'stat'"):
        trl_environment_factory(Counter, stat=1)


def test_reset_returning_something_else_is_named():
    class Odd:
        def reset(self, **kwargs) -> int:
            return 3

    with pytest.raises(EnvError, match=r"Odd.reset: returned a int, not None or a string"):
        trl_environment_factory(Odd)().reset({"prompt": "hi"})

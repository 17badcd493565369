"""Environment specs: built-ins, the generic tool environment, user classes from files (posttrain or TRL)."""

from __future__ import annotations

import textwrap

import pytest

from posttrain.envs.environment import EnvError
from posttrain.envs.guess_number import GuessNumberEnvironment
from posttrain.envs.loading import load_environment_factory, load_tools
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import ToolError
from posttrain.envs.trl_adapter import TRLEnvironment

pytest.importorskip("transformers")

USER_FILE = textwrap.dedent(
    '''
    from posttrain.envs.environment import EnvStep


    def shout(text: str) -> str:
        """Shout.

        Args:
            text: What to shout.
        """
        return text.upper()


    class Echo:
        tools = []

        def __init__(self, suffix: str = "!"):
            self.suffix = suffix

        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, turn):
            return EnvStep(observations=[{"role": "user", "content": turn.content + self.suffix}], done=True)

        def episode_reward(self):
            return 0.5


    class Wallet:
        def reset(self, **kwargs):
            self.money = 10

        def spend(self, amount: int) -> str:
            """Spend money.

            Args:
                amount: How much.
            """
            self.money -= amount
            return str(self.money)


    class Broken:
        def reset(self, **kwargs):
            pass

        def tool(self, x):
            """No hint."""


    NOT_A_CLASS = 3
    '''
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(USER_FILE)
    return path


def test_builtins():
    calculator = load_environment_factory("calculator")()
    assert isinstance(calculator, ToolEnvironment) and [t.name for t in calculator.tools] == ["calculator"]
    factory = load_environment_factory("guess_number", options={"max_turns": 4})
    first, second = factory(), factory()
    assert isinstance(first, GuessNumberEnvironment) and first.game.max_turns == 4 and first is not second
    generic = load_environment_factory("tools", tools=["calculator", "python"], options={"system_prompt": "hi"})()
    assert [t.name for t in generic.tools] == ["calculator", "python"] and generic.system_prompt == "hi"


def test_user_classes_and_tools_from_a_file(user_file):
    echo = load_environment_factory(f"{user_file}:Echo", options={"suffix": "?"})()
    echo.reset({"prompt": "hi"})
    assert echo.step(parse_hermes("why")).observations[0]["content"] == "why?"
    wallet = load_environment_factory(f"{user_file}:Wallet", tools=[f"{user_file}:shout"])()
    assert isinstance(wallet, TRLEnvironment) and sorted(t.name for t in wallet.tools) == ["shout", "spend"]
    wallet.reset({"prompt": "spend 3"})
    step = wallet.step(parse_hermes('<tool_call>{"name": "spend", "arguments": {"amount": 3}}</tool_call>'))
    assert step.observations[0]["content"] == "7"
    by_module = load_environment_factory("posttrain.envs.guess_number:GuessNumberEnvironment")()
    assert isinstance(by_module, GuessNumberEnvironment)


def test_errors_name_the_spec(user_file):
    with pytest.raises(
        EnvError, match=r"unknown environment 'calculater' \(built-ins: calculator, guess_number, tools"
    ):
        load_environment_factory("calculater")
    with pytest.raises(
        EnvError, match=r"environment 'guess_number': .*'max_turn' \(options: max_turns, system_prompt, show_range\)"
    ):
        load_environment_factory("guess_number", options={"max_turn": 3})
    with pytest.raises(EnvError, match=r"environment 'guess_number': .*max_turns must be a positive integer"):
        load_environment_factory("guess_number", options={"max_turns": -1})
    with pytest.raises(EnvError, match="environment 'tools': give the tools it offers"):
        load_environment_factory("tools")
    with pytest.raises(EnvError, match="environment 'calculator' has its own tools"):
        load_environment_factory("calculator", tools=["python"])
    with pytest.raises(EnvError, match=r"unknown tool 'calc' \(built-ins: calculator, calculate, python"):
        load_tools(["calc"])
    with pytest.raises(EnvError, match=r"environment '.*my_envs.py:Nope': .* has no 'Nope' \(it defines: .*Echo"):
        load_environment_factory(f"{user_file}:Nope")
    with pytest.raises(EnvError, match=r"environment '.*:NOT_A_CLASS' is a int, not a class"):
        load_environment_factory(f"{user_file}:NOT_A_CLASS")
    with pytest.raises(EnvError, match=r"file .*missing.py not found"):
        load_environment_factory("missing.py:Env")
    with pytest.raises(ToolError, match=r"tool Broken.tool: Argument x is missing a type hint"):
        load_environment_factory(f"{user_file}:Broken")
    with pytest.raises(EnvError, match=r"cannot import no_such_module"):
        load_environment_factory("no_such_module:Env")
    with pytest.raises(EnvError, match="tools= applies to 'tools' and TRL environments, not to Echo"):
        load_environment_factory(f"{user_file}:Echo", tools=["calculator"])

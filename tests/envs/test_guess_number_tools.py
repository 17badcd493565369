"""The guessing game in its tool form (posttrain/envs/guess_number_tools.py): a TRL environment_factory class that
posttrain plays through its adapter, its answers the text form's, its cold-start transcripts the same games."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.envs import guess_number_tools
from posttrain.envs.environment import EnvError
from posttrain.envs.guess_number import GuessNumberEnvironment
from posttrain.envs.guess_number_tools import GuessNumberGame
from posttrain.envs.loading import load_environment_factory
from posttrain.envs.transcripts import guess_number_tool_transcripts, guess_number_transcripts, main
from posttrain.envs.trl_adapter import check_trl_environment_class
from posttrain.envs.turns import ParsedTurn, ToolCall
from posttrain.tasks.guess_number import GuessNumberTask
from posttrain.trainers.rl.config import GRPOConfig

ROOT = Path(__file__).resolve().parents[2]
SPEC = "posttrain.envs.guess_number_tools:GuessNumberGame"
ROW = {"prompt": [{"role": "user", "content": "Guess."}], "secret": 37, "low": 1, "high": 100}


def call(number: object, index: int = 0) -> ParsedTurn:
    return ParsedTurn(
        text="", content="", tool_calls=[ToolCall(name="guess", arguments={"number": number}, id=f"c{index}")]
    )


def play(env, numbers: list[object]) -> list[str]:  # noqa: ANN001
    answers = []
    for index, number in enumerate(numbers):
        step = env.step(call(number, index))
        assert not step.done  # a tool turn never ends the episode: the turn without a call does
        (message,) = step.observations
        assert message["role"] == "tool" and message["name"] == "guess"
        answers.append(message["content"])
    return answers


def test_the_class_is_a_trl_environment_with_one_integer_tool() -> None:
    schemas = check_trl_environment_class(GuessNumberGame)
    assert list(schemas) == ["guess"]
    assert schemas["guess"]["function"]["parameters"]["properties"]["number"]["type"] == "integer"
    game = GuessNumberGame()  # TRL builds it without arguments: the demo's game
    assert game.game.max_turns == 7 and game.game.show_range


def test_a_won_game_through_the_adapter() -> None:
    env = load_environment_factory(SPEC, options={"max_turns": 7, "system_prompt": "Play."})()
    messages = env.reset(ROW)
    assert messages[0] == {"role": "system", "content": "Play."} and messages[1:] == ROW["prompt"]
    assert play(env, [50, 25, "37"]) == [
        "Lower. It is between 1 and 49. 6 guesses left.",
        "Higher. It is between 26 and 49. 5 guesses left.",
        "Correct!",  # a numeric string is the same guess
    ]
    assert play(env, [37]) == ["The game is over: the number was 37."]  # no second win, the budget untouched
    assert env.step(ParsedTurn(text="It is 37.", content="It is 37.")).done
    assert env.episode_reward() == 1.0


def test_the_budget_and_invalid_guesses() -> None:
    env = load_environment_factory(SPEC, options={"max_turns": 3, "show_range": False})()
    env.reset({**ROW, "secret": 90})
    answers = play(env, [42.5, True, 89, 95])
    assert answers[:2] == ["Please answer with a single whole number. 2 guesses left."] + [
        "Please answer with a single whole number. 1 guesses left."
    ]  # not whole, a bool: invalid guesses that still use a turn
    assert answers[2:] == ["Higher. No guesses left.", "The game is over: no guesses left."]
    assert env.episode_reward() == 0.0


def test_the_answers_are_the_text_forms() -> None:
    tool_env = load_environment_factory(SPEC)()
    text_env = GuessNumberEnvironment(max_turns=7, show_range=True)
    tool_env.reset(ROW), text_env.reset(ROW)
    for number in (80, 10, 40, 30, 35, 36):
        (text,) = text_env.step(ParsedTurn(text=str(number), content=str(number))).observations
        assert play(tool_env, [number]) == [text["content"]]


def test_bad_options_and_rows_name_the_value() -> None:
    with pytest.raises(EnvError, match="max_turns must be a positive integer, got 0"):
        load_environment_factory(SPEC, options={"max_turns": 0})
    with pytest.raises(EnvError, match="GuessNumberGame: .*'budget'"):
        load_environment_factory(SPEC, options={"budget": 3})
    env = load_environment_factory(SPEC)()
    with pytest.raises(EnvError, match="the row's secret 120 is outside"):
        env.reset({**ROW, "secret": 120})


def test_transcripts_are_the_text_forms_games_as_calls(tmp_path: Path) -> None:
    tool_games = guess_number_tool_transcripts(6, seed=3, show_range=True)
    text_games = guess_number_transcripts(6, seed=3, show_range=True)
    secrets = [row["secret"] for row in GuessNumberTask(seed=3).sample(6)]
    assert len(set(secrets)) > 1
    for tool_game, text_game, secret in zip(tool_games, text_games, secrets, strict=True):
        messages = tool_game["messages"]
        assert messages[0]["content"] == guess_number_tools.SYSTEM_PROMPT
        assert [t["function"]["name"] for t in tool_game["tools"]] == ["guess"]
        calls = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in messages if m.get("tool_calls")]
        guesses = [int(m["content"]) for m in text_game["messages"][2:] if m["role"] == "assistant"]
        assert calls == guesses  # the same player, the same games
        # the text form stops at the last guess; the tool form has that guess's answer and a closing turn
        answers = [m["content"] for m in messages if m["role"] == "tool"]
        assert answers[:-1] == [m["content"] for m in text_game["messages"][2:] if m["role"] == "user"]
        won = guesses[-1] == secret
        assert (answers[-1] == "Correct!") == won
        last = messages[-1]
        assert last["role"] == "assistant" and "tool_calls" not in last
        assert last["content"] == (f"The number is {secret}." if won else "I ran out of guesses.")
    main(["--env", "guess_number_tools", "--out", str(tmp_path / "t.jsonl"), "--rows", "2", "--show-range"])
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 2


def test_the_shipped_cold_start_and_config_agree() -> None:
    rows = [json.loads(line) for line in (ROOT / "examples/data/guess_number_tools/sft.jsonl").open()]
    assert rows == guess_number_tool_transcripts(64, show_range=True)  # the file is what the docstring's command writes
    cfg = load_config(GRPOConfig, ROOT / "examples" / "agent_guess_number_tools.yaml")
    assert cfg.env.name == SPEC and cfg.env.options["system_prompt"] == guess_number_tools.SYSTEM_PROMPT
    assert cfg.env.max_turns == cfg.env.options["max_turns"] + 1  # the guesses and the closing turn

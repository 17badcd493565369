"""The built-in environments: calculator (exact final number) and guess_number (feedback, turn budget)."""

from __future__ import annotations

import pytest

from posttrain.envs.calculator import SYSTEM_PROMPT, calculator_environment, exact_final_number
from posttrain.envs.environment import EnvError
from posttrain.envs.guess_number import GuessNumberEnvironment
from posttrain.envs.tool_calls import parse_hermes
from posttrain.tasks import make_task

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


def test_calculator_episode_solved_with_the_tool():
    row = {"prompt": [{"role": "user", "content": "What is 347 times 29?"}], "answer": "10063"}
    env = calculator_environment()
    assert env.reset(row) == [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]]
    assert env.step(parse_hermes(CALL % "347 * 29")).observations[0]["content"] == "10063"
    assert env.step(parse_hermes("The answer is 10063.")).done
    assert env.episode_reward() == 1.0


@pytest.mark.parametrize(
    ("final", "reward"),
    [("The answer is 10063.", 1.0), ("10,063", 1.0), ("The answer is 10062.", 0.0), ("I am not sure.", 0.0)],
)
def test_calculator_reward_is_the_exact_final_number(final, reward):
    assert exact_final_number(final, {"answer": "10063"}) == reward
    assert exact_final_number(final, {}) is None


def test_calculator_on_task_rows():
    row = make_task("multiplication", seed=2).sample(1)[0]
    env = calculator_environment()
    env.reset(row)
    env.step(parse_hermes("The answer is 1."))  # no tool, a wrong guess
    assert env.episode_reward() == 0.0


def test_guess_number_binary_search_solves_it():
    env = GuessNumberEnvironment(max_turns=7)
    row = make_task("guess_number", seed=0).sample(1)[0]
    messages = env.reset(row)
    assert messages[-1]["content"].startswith("I am thinking of a number between 1 and 100")
    low, high, turns = 1, 100, 0
    while True:
        guess = (low + high) // 2
        step = env.step(parse_hermes(f"My guess is {guess}."))
        turns += 1
        feedback = step.observations[0]
        assert feedback["role"] == "user"
        if step.done:
            break
        if feedback["content"].startswith("Higher."):
            low = guess + 1
        else:
            assert feedback["content"].startswith("Lower.")
            high = guess - 1
    assert feedback["content"] == "Correct!" and env.episode_reward() == 1.0 and turns <= 7


def test_guess_number_feedback_and_budget():
    env = GuessNumberEnvironment(max_turns=3)
    env.reset({"prompt": "guess", "secret": 40})
    first = env.step(parse_hermes("50"))
    assert first.observations == [{"role": "user", "content": "Lower. 2 guesses left."}] and not first.done
    second = env.step(parse_hermes("no idea"))
    assert second.observations[0]["content"] == "Please answer with a single whole number. 1 guesses left."
    assert second.counts == {"guesses": 1, "invalid_guesses": 1, "out_of_range_guesses": 0}
    last = env.step(parse_hermes("30"))
    assert last.done and last.observations[0]["content"] == "Higher. No guesses left."
    assert env.episode_reward() == 0.0
    env.reset({"prompt": "guess", "secret": 40})  # a fresh game
    assert env.step(parse_hermes("40")).done and env.episode_reward() == 1.0


def test_guess_number_bad_input():
    with pytest.raises(EnvError, match="max_turns must be a positive integer, got 0"):
        GuessNumberEnvironment(max_turns=0)
    with pytest.raises(EnvError, match="the row's 'secret' must be an integer, got None"):
        GuessNumberEnvironment().reset({"prompt": "guess"})

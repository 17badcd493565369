"""The `guess_number` environment: find a secret number from "higher" / "lower" answers, within a turn budget.

Genuinely multi-turn and tool-free: each model turn is a guess (the last whole number in the turn's text),
and the environment answers as the user: "Higher.", "Lower." or "Correct!" (which ends the episode). A turn
without a number is answered with a reminder and still uses up a turn. The episode ends after `max_turns`
guesses; its reward is 1.0 when the number was found within them, else 0.0.

`show_range=True` adds the range still consistent with every answer so far to each answer ("Higher. It is
between 38 and 100. 6 guesses left."): the state a good player tracks is then on the page, and what is left to
learn is the choice within it (the middle halves the range, so binary search solves 1..100 in 7 guesses, a
uniformly random pick within the range in 51% of games).

Rows: `{"prompt": ..., "secret": 37, "low": 1, "high": 100}` (the `guess_number` task writes them); `low` and
`high` (the range `show_range` starts from) default to 1 and 100.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.envs.environment import EnvError, EnvStep, Message
from posttrain.envs.tool_env import opening_messages
from posttrain.envs.turns import ParsedTurn
from posttrain.rewards.answers import last_number

DEFAULT_MAX_TURNS = 8
BISECTION_TURNS = 7  # what binary search needs to find any number in 1..100: ceil(log2(101))
DEFAULT_LOW, DEFAULT_HIGH = 1, 100
SYSTEM_PROMPT = "You are playing a guessing game. Reply with your guess only: one whole number."


class GuessingGame:
    """One game's state and answers, shared by the text form (GuessNumberEnvironment) and the tool form
    (posttrain.envs.guess_number_tools): the secret, the range the answers so far allow, the guesses used."""

    def __init__(self, max_turns: int = DEFAULT_MAX_TURNS, show_range: bool = False) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise EnvError(f"guess_number environment: max_turns must be a positive integer, got {max_turns!r}")
        if not isinstance(show_range, bool):
            raise EnvError(f"guess_number environment: show_range must be true or false, got {show_range!r}")
        self.max_turns, self.show_range = max_turns, show_range
        self.secret = 0
        self.low, self.high = DEFAULT_LOW, DEFAULT_HIGH  # the range consistent with the answers so far
        self.guesses = 0
        self.solved = False

    def start(self, row: Mapping[str, Any]) -> None:
        """A new game on the row's secret (and range); bad values raise EnvError naming the key."""
        secret = row.get("secret")
        if isinstance(secret, bool) or not isinstance(secret, int):
            raise EnvError(f"guess_number environment: the row's 'secret' must be an integer, got {secret!r}")
        low, high = row.get("low", DEFAULT_LOW), row.get("high", DEFAULT_HIGH)
        for key, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise EnvError(f"guess_number environment: the row's {key!r} must be an integer, got {value!r}")
        if not low <= secret <= high:
            raise EnvError(f"guess_number environment: the row's secret {secret} is outside [{low}, {high}]")
        self.secret, self.low, self.high, self.guesses, self.solved = secret, low, high, 0, False

    @property
    def over(self) -> bool:
        return self.solved or self.guesses >= self.max_turns

    def reward(self) -> float:
        """1.0 when the secret was found within the budget, else 0.0 (both forms' episode reward)."""
        return 1.0 if self.solved else 0.0

    def answer(self, guess: int | None) -> tuple[str, bool, dict[str, float]]:
        """One guess (None: the turn held no whole number) -> (the answer's text, whether the game is over,
        the turn's counts). Uses up one of the budget's guesses."""
        self.guesses += 1
        # out_of_range_guesses: whole numbers outside the range the answers so far allow (a wasted guess)
        counts = {"guesses": 1.0, "invalid_guesses": 0.0, "out_of_range_guesses": 0.0}
        if guess is None:
            counts["invalid_guesses"] = 1.0
            feedback = "Please answer with a single whole number."
        elif guess == self.secret:
            self.solved = True
            return "Correct!", True, counts
        else:
            counts["out_of_range_guesses"] = float(not self.low <= guess <= self.high)
            if guess < self.secret:
                feedback, self.low = "Higher.", max(self.low, guess + 1)
            else:
                feedback, self.high = "Lower.", min(self.high, guess - 1)
            if self.show_range:
                feedback += f" It is between {self.low} and {self.high}."
        remaining = self.max_turns - self.guesses
        if remaining <= 0:
            return f"{feedback} No guesses left.", True, counts
        return f"{feedback} {remaining} guesses left.", False, counts


class GuessNumberEnvironment:
    """One guessing game in text (see the module docstring)."""

    tools: list[Any] = []

    def __init__(
        self, max_turns: int = DEFAULT_MAX_TURNS, system_prompt: str | None = SYSTEM_PROMPT, show_range: bool = False
    ) -> None:
        self.tools = []
        self.game = GuessingGame(max_turns, show_range)
        self.system_prompt = system_prompt

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.game.start(row)
        return opening_messages(row, self.system_prompt)

    def step(self, turn: ParsedTurn) -> EnvStep:
        number = last_number(turn.content)
        guess = int(number) if number is not None and number == number.to_integral_value() else None
        text, done, counts = self.game.answer(guess)
        return EnvStep(observations=[{"role": "user", "content": text}], done=done, counts=counts)

    def episode_reward(self) -> float | None:
        return self.game.reward()

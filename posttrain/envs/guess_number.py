"""The `guess_number` environment: find a secret number from "higher" / "lower" answers, within a turn budget.

Genuinely multi-turn and tool-free: each model turn is a guess (the last whole number in the turn's text),
and the environment answers as the user: "Higher.", "Lower." or "Correct!" (which ends the episode). A turn
without a number is answered with a reminder and still uses up a turn. The episode ends after `max_turns`
guesses; its reward is 1.0 when the number was found within them, else 0.0.

Rows: `{"prompt": ..., "secret": 37, "low": 1, "high": 100}` (the `guess_number` task writes them); `low` and
`high` default to the environment's own range.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.envs.environment import EnvError, EnvStep, Message
from posttrain.envs.tool_env import opening_messages
from posttrain.envs.turns import ParsedTurn
from posttrain.rewards.answers import last_number

DEFAULT_MAX_TURNS = 8  # binary search finds any number in 1..100 in 7 guesses


class GuessNumberEnvironment:
    """One guessing game (see the module docstring)."""

    tools: list[Any] = []

    def __init__(self, max_turns: int = DEFAULT_MAX_TURNS, system_prompt: str | None = None) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise EnvError(f"guess_number environment: max_turns must be a positive integer, got {max_turns!r}")
        self.tools = []
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.secret = 0
        self.guesses = 0
        self.solved = False

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        secret = row.get("secret")
        if isinstance(secret, bool) or not isinstance(secret, int):
            raise EnvError(f"guess_number environment: the row's 'secret' must be an integer, got {secret!r}")
        self.secret, self.guesses, self.solved = secret, 0, False
        return opening_messages(row, self.system_prompt)

    def step(self, turn: ParsedTurn) -> EnvStep:
        self.guesses += 1
        guess = last_number(turn.content)
        counts = {"guesses": 1.0, "invalid_guesses": 0.0}
        if guess is None or guess != guess.to_integral_value():
            counts["invalid_guesses"] = 1.0
            feedback = "Please answer with a single whole number."
        elif int(guess) == self.secret:
            self.solved = True
            return EnvStep(observations=[_user("Correct!")], done=True, counts=counts)
        else:
            feedback = "Higher." if int(guess) < self.secret else "Lower."
        remaining = self.max_turns - self.guesses
        if remaining <= 0:
            return EnvStep(observations=[_user(f"{feedback} No guesses left.")], done=True, counts=counts)
        return EnvStep(observations=[_user(f"{feedback} {remaining} guesses left.")], counts=counts)

    def episode_reward(self) -> float | None:
        return 1.0 if self.solved else 0.0


def _user(text: str) -> Message:
    return {"role": "user", "content": text}

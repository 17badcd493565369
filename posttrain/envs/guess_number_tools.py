"""The guessing game as a tool, written to TRL's `environment_factory` convention: each guess is a call of the
`guess` tool, and the game owns its reward (`get_reward`).

The same game as `guess_number` (posttrain/envs/guess_number.py: the secret, the turn budget, the answers
"Higher. It is between 58 and 100. 6 guesses left."), in the form TRL's GRPOTrainer can play, so the two
stacks train on the same task (benchmarks/agent_vs_trl.py --task guess_number_tools). posttrain runs the class
unchanged through its TRL adapter (posttrain/envs/trl_adapter.py):

    env:
      name: posttrain.envs.guess_number_tools:GuessNumberGame
      options: {max_turns: 7, show_range: true, system_prompt: ...}

and TRL takes it as `GRPOTrainer(environment_factory=GuessNumberGame, ...)`. An episode ends at the first
model turn without a tool call (TRL's rule), so after "Correct!" the model says the number and stops; guesses
after the game is over are answered without using the budget. Reward: 1.0 when the secret was guessed within
`max_turns` guesses, else 0.0.
"""

from __future__ import annotations

from typing import Any

from posttrain.envs.guess_number import BISECTION_TURNS, GuessingGame

SYSTEM_PROMPT = (
    "You are playing a guessing game. Make each guess by calling the guess tool with one whole number. "
    "When it answers Correct!, reply with the number."
)


class GuessNumberGame:
    """One guessing game whose guesses are `guess` tool calls (see the module docstring)."""

    # TRL builds the class without arguments: the defaults are the demo's game (7 guesses, the range stated)
    def __init__(self, max_turns: int = BISECTION_TURNS, show_range: bool = True) -> None:
        self.game = GuessingGame(max_turns, show_range)

    def reset(self, **row: Any) -> None:
        """A new game on the dataset row's `secret` (and `low` / `high`), as TRL calls it before each episode."""
        self.game.start(row)

    def guess(self, number: int) -> str:
        """Guess the secret number; the answer says whether it is higher or lower.

        Args:
            number: the guess, one whole number.
        """
        if self.game.solved:
            return f"The game is over: the number was {self.game.secret}."
        if self.game.over:
            return "The game is over: no guesses left."
        text, _, _ = self.game.answer(_whole(number))
        return text

    def get_reward(self) -> float:
        return self.game.reward()


def _whole(value: Any) -> int | None:
    """The tool argument as a whole number (42, "42", 42.0), else None: an invalid guess, which still uses a turn."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None

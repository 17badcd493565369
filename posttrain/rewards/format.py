"""Format rewards: does the completion follow a required shape (a regular expression)?"""

from __future__ import annotations

import re
from typing import Any

from posttrain.rewards.base import RewardError, RewardFn, completion_text

# The R1-style "reason, then answer" layout.
THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"

MATCH_MODES = ("fullmatch", "search")


def format_reward(pattern: str, *, mode: str = "fullmatch", strip: bool = True, flags: int = re.DOTALL) -> RewardFn:
    """A reward function giving 1.0 where the completion text matches `pattern`, else 0.0.

    mode "fullmatch": the whole completion must match (e.g. `<think>.*</think>\\s*<answer>.*</answer>`);
    mode "search": the pattern may match anywhere. `strip` removes the completion's leading and trailing
    whitespace first. `flags` default to re.DOTALL so `.` spans lines. Never None: every completion has
    a format.
    """
    if mode not in MATCH_MODES:
        raise RewardError(f"format_reward: mode must be one of {', '.join(MATCH_MODES)}, got {mode!r}")
    try:
        regex = re.compile(pattern, flags)
    except (re.error, TypeError) as error:
        raise RewardError(f"format_reward: invalid regular expression {pattern!r}: {error}") from None
    matcher = regex.fullmatch if mode == "fullmatch" else regex.search

    def format_match(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        rewards: list[float | None] = []
        for completion in completions:
            text = completion_text(completion)
            rewards.append(1.0 if matcher(text.strip() if strip else text) else 0.0)
        return rewards

    format_match.__doc__ = f"1.0 where the completion {mode}es {pattern!r}, else 0.0."
    format_match.pattern = pattern  # type: ignore[attr-defined]  # shown in logs and errors
    return format_match

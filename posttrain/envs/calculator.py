"""The `calculator` environment: multiplication problems (the `multiplication` task) with a calculator tool.

The default 135M model cannot multiply a 3-digit by a 2-digit number alone; with the tool it only has to
call it with the right expression and copy the result. The episode's reward is 1.0 when the last number of
the final answer (the turn without a tool call) is the exact product, else 0.0; an episode the rollout cut
short scores 0. `calculator_transcripts` (posttrain.envs.transcripts) writes SFT examples in this format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.envs.builtin_tools import calculator
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import DEFAULT_TOOL_TIMEOUT_S
from posttrain.rewards.answers import last_number, reference_number

SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the calculator tool for arithmetic, then reply with 'The answer is <number>.'"
)
FINAL_ANSWER = "The answer is {answer}."


def exact_final_number(final_text: str, row: Mapping[str, Any]) -> float | None:
    """1.0 if the final answer's last number equals the row's `answer`, 0.0 if not, None without a reference."""
    expected = reference_number(row.get("answer"))
    if expected is None:
        return None
    return 1.0 if last_number(final_text) == expected else 0.0


def calculator_environment(
    system_prompt: str = SYSTEM_PROMPT, tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
) -> ToolEnvironment:
    """One episode's environment: the calculator tool and the exact-answer reward."""
    return ToolEnvironment(
        [calculator], system_prompt=system_prompt, tool_timeout_s=tool_timeout_s, check_answer=exact_final_number
    )

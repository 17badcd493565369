"""The `word_problems` environment: chained word problems (the `word_problems` task) with a one-step calculator.

The `calculate` tool computes one operation per call, so a problem of k operations takes k calls, each on the
result of the one before: the model must read the tool's answer and carry it into its next call, and decide
after each answer whether another step is left. The episode's reward is 1.0 when the last number of the final
answer (the turn without a tool call) is the exact result, else 0.0; an episode cut short scores 0.
`word_problem_transcripts` (posttrain.envs.transcripts) writes solved episodes for an SFT cold start.
"""

from __future__ import annotations

from posttrain.envs.builtin_tools import calculate
from posttrain.envs.calculator import exact_final_number
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import DEFAULT_TOOL_TIMEOUT_S

SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the problem with the calculate tool, one operation per call, using each "
    "result in the next call. Then reply with 'The answer is <number>.'"
)


def word_problems_environment(
    system_prompt: str = SYSTEM_PROMPT, tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
) -> ToolEnvironment:
    """One episode's environment: the one-operation `calculate` tool and the exact-answer reward."""
    return ToolEnvironment(
        [calculate], system_prompt=system_prompt, tool_timeout_s=tool_timeout_s, check_answer=exact_final_number
    )

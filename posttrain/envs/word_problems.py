"""The `word_problems` environment: chained word problems (the `word_problems` task) with a one-step calculator.

The `calculate` tool computes one operation per call, so a problem of k operations takes k calls, each on the
result of the one before: the model must read the tool's answer and carry it into its next call, and decide
after each answer whether another step is left. The episode's reward is 1.0 when the last number of the final
answer (the turn without a tool call) is the exact result, else 0.0; an episode cut short scores 0.

`step_reward` (option, default 0: off) is a process reward for training: each call whose result is the next
intermediate value of the row's chain earns it as the turn's reward (`EnvStep.reward`, added to the outcome
with `env.turn_rewards: sum`), in order, so a repeated or skipped step earns nothing. It gives a group whose
episodes all miss the final answer something to compare (how far each got); the held-out success is the
outcome alone. Rows without a `chain` (the shipped test file) earn no step rewards.
`word_problem_transcripts` (posttrain.envs.transcripts) writes solved episodes for an SFT cold start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.envs.builtin_tools import calculate
from posttrain.envs.calculator import exact_final_number
from posttrain.envs.environment import EnvError, EnvStep, Message
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import DEFAULT_TOOL_TIMEOUT_S
from posttrain.envs.turns import ParsedTurn
from posttrain.tasks.word_problems import running_values

SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the problem with the calculate tool, one operation per call, using each "
    "result in the next call. Then reply with 'The answer is <number>.'"
)


def intermediate_values(row: Mapping[str, Any]) -> list[str]:
    """The results of the chain's steps in order, as `calculate` writes them ([] for a row without a chain)."""
    if "chain" not in row or "start" not in row:
        return []
    return [str(value) for value in running_values(int(row["start"]), [(op, int(n)) for op, n in row["chain"]])]


def steps_matched(results: list[str], targets: list[str], done: int = 0) -> int:
    """How many of `results` (tool answers, in order) hit the next intermediate values after `done` of them."""
    matched = 0
    for result in results:
        if done + matched < len(targets) and result == targets[done + matched]:
            matched += 1
    return matched


class WordProblemsEnvironment(ToolEnvironment):
    """The tool environment with `calculate`, the exact-answer reward and the optional per-step reward."""

    def __init__(
        self,
        system_prompt: str = SYSTEM_PROMPT,
        tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
        step_reward: float = 0.0,
    ) -> None:
        if isinstance(step_reward, bool) or not isinstance(step_reward, (int, float)) or not 0 <= step_reward <= 1:
            raise EnvError(f"word_problems: step_reward must be a number in [0, 1], got {step_reward!r}")
        super().__init__(
            [calculate], system_prompt=system_prompt, tool_timeout_s=tool_timeout_s, check_answer=exact_final_number
        )
        self.step_reward = float(step_reward)
        self.targets: list[str] = []
        self.steps_done = 0

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.targets, self.steps_done = intermediate_values(row), 0
        return super().reset(row)

    def step(self, turn: ParsedTurn) -> EnvStep:
        result = super().step(turn)
        earned = steps_matched([str(m.get("content")) for m in result.observations], self.targets, self.steps_done)
        self.steps_done += earned
        if self.targets:  # the steps done right, counted as env/correct_steps; rewarded when step_reward is set
            result.counts = {**result.counts, "correct_steps": float(earned)}
            if self.step_reward:
                result.reward = self.step_reward * earned
        return result

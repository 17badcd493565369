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

`extra_call_penalty` (option, default 0: off) is its counterweight: each call past the chain's length (the
problem has k steps, the model makes a (k+1)-th call or more) costs that much as the turn's reward. Without it
the step rewards pay for calling: an episode that calls until it is cut off collects every step it happens to
hit and loses nothing, so the policy drifts to the longest chains (measured in docs/agents.md); with it, an
episode scores most by making exactly the problem's number of calls. `env/extra_calls` counts those calls.
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
        extra_call_penalty: float = 0.0,
    ) -> None:
        for name, value in (("step_reward", step_reward), ("extra_call_penalty", extra_call_penalty)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise EnvError(f"word_problems: {name} must be a number in [0, 1], got {value!r}")
        super().__init__(
            [calculate], system_prompt=system_prompt, tool_timeout_s=tool_timeout_s, check_answer=exact_final_number
        )
        self.step_reward = float(step_reward)
        self.extra_call_penalty = float(extra_call_penalty)
        self.targets: list[str] = []
        self.steps_done = self.calls = 0

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.targets, self.steps_done, self.calls = intermediate_values(row), 0, 0
        return super().reset(row)

    def step(self, turn: ParsedTurn) -> EnvStep:
        result = super().step(turn)
        earned = steps_matched([str(m.get("content")) for m in result.observations], self.targets, self.steps_done)
        self.steps_done += earned
        calls = len(turn.tool_calls)
        extra = max(0, self.calls + calls - len(self.targets)) - max(0, self.calls - len(self.targets))
        self.calls += calls
        if self.targets:  # counted as env/correct_steps and env/extra_calls; rewarded when the options are set
            result.counts = {**result.counts, "correct_steps": float(earned), "extra_calls": float(extra)}
            if self.step_reward or self.extra_call_penalty:
                result.reward = self.step_reward * earned - self.extra_call_penalty * extra
        return result

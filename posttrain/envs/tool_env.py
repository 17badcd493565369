"""The generic tool environment: the model calls tools until it answers without one.

    env = ToolEnvironment([calculator], system_prompt="Use the calculator.")
    messages = env.reset({"prompt": "What is 347 times 29?"})
    step = env.step(parse_hermes(model_text))   # tool messages for each call, run concurrently
    ...                                        # a turn without tool calls ends the episode

Opening messages come from the row's `prompt` column: a string (one user message) or chat messages. The
system prompt, if given, opens the conversation unless the row's messages already start with one.

A call that could not be parsed (`ParsedTurn.errors`) is answered with a tool-role message carrying the
error, with no `tool_call_id` (there is no call to answer), so the model sees why and may retry; each counts
as a `parse_failures`. A turn with parse errors but no valid call does not end the episode.

`check_answer(final_text, row) -> float | None`, when given, is the episode's reward from the final answer
(the text of the turn that ended the episode); without it `episode_reward` is None and the run's reward
functions score the episode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from posttrain.envs.environment import EnvError, EnvStep, Message
from posttrain.envs.tools import DEFAULT_TOOL_TIMEOUT_S, Tool, as_tools, run_tool_call
from posttrain.envs.turns import ParsedTurn

AnswerCheck = Callable[[str, Mapping[str, Any]], "float | None"]


def opening_messages(row: Mapping[str, Any], system_prompt: str | None = None) -> list[Message]:
    """The episode's first messages from the row's `prompt` (a string or chat messages) and a system prompt."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        messages = [dict(message) for message in prompt]
    else:
        shown = "no 'prompt' column" if prompt is None else f"a 'prompt' of type {type(prompt).__name__}"
        raise EnvError(f"environment row has {shown}; expected a string or a list of chat messages")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def parse_failure_observations(turn: ParsedTurn) -> list[Message]:
    """One tool-role message per call that could not be parsed (no id: there is no call to answer)."""
    return [{"role": "tool", "content": f"Error: {error}"} for error in turn.errors]


def add_counts(total: dict[str, float], counts: Mapping[str, float]) -> dict[str, float]:
    for key, value in counts.items():
        total[key] = total.get(key, 0.0) + value
    return total


def run_tool_calls(
    tools_by_name: Mapping[str, Tool], turn: ParsedTurn, timeout_s: float
) -> tuple[list[Message], dict[str, float]]:
    """Run the turn's calls (concurrently when several) -> (tool messages in call order, summed counts).
    Parse errors come after the results, as error observations counted under `parse_failures`."""
    counts: dict[str, float] = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
    counts["parse_failures"] = float(len(turn.errors))
    calls = turn.tool_calls
    if len(calls) == 1:
        results = [run_tool_call(tools_by_name, calls[0], timeout_s)]
    elif calls:
        with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="tool-call") as pool:
            results = list(pool.map(lambda call: run_tool_call(tools_by_name, call, timeout_s), calls))
    else:
        results = []
    for _, call_counts in results:
        add_counts(counts, call_counts)
    return [message for message, _ in results] + parse_failure_observations(turn), counts


class ToolEnvironment:
    """Tools the model may call, until it answers without a call (see the module docstring)."""

    def __init__(
        self,
        tools: Iterable[Callable[..., Any] | Tool],
        system_prompt: str | None = None,
        tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
        check_answer: AnswerCheck | None = None,
    ) -> None:
        if not tool_timeout_s > 0:
            raise EnvError(f"tool environment: tool_timeout_s must be positive, got {tool_timeout_s!r}")
        self.tools = as_tools(tools)
        self.tools_by_name = {tool.name: tool for tool in self.tools}
        self.system_prompt = system_prompt
        self.tool_timeout_s = tool_timeout_s
        self.check_answer = check_answer
        self.row: Mapping[str, Any] = {}
        self.final_text: str | None = None

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.row, self.final_text = row, None
        return opening_messages(row, self.system_prompt)

    def step(self, turn: ParsedTurn) -> EnvStep:
        if not turn.tool_calls and not turn.errors:
            self.final_text = turn.content
            return EnvStep(done=True, counts={"parse_failures": 0.0})
        observations, counts = run_tool_calls(self.tools_by_name, turn, self.tool_timeout_s)
        return EnvStep(observations=observations, counts=counts)

    def episode_reward(self) -> float | None:
        if self.check_answer is None:
            return None
        # an episode cut short by the rollout (turn or token limit) never answered: no credit
        return 0.0 if self.final_text is None else self.check_answer(self.final_text, self.row)

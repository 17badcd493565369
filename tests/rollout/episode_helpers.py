"""A scripted environment, a plain parser and a tiny random model that ends its turns, for the episode tests."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.envs import EnvStep, ParsedTurn
from posttrain.rollout.chat_tokens import ChatTokens
from posttrain.rollout.episodes import EpisodeLimits, EpisodeRunner
from tests.data.tiny import tiny_model, tiny_tokenizer

EOS = 2  # <|im_end|> in tests/data/tiny.py's tokenizer: the ChatML end of turn


def turn_ending_model(seed: int = 0, eos_boost: float = 2.0):
    """tests/data/tiny.py's random model (tied embeddings), made to end its turns after a few tokens: every
    embedding row gets a large constant first component, so the final hidden state's first component is
    positive whatever the token; that shifts every logit alike (no effect) except EOS's, which gets more."""
    model = tiny_model(seed)
    with torch.no_grad():
        weight = model.embed_tokens.weight  # (V, d), also the LM head
        weight[:, 0] += 4.0
        weight[EOS, 0] += eos_boost
    return model.eval()


def plain_parser(text: str, first_call_index: int = 0) -> ParsedTurn:
    """No tool-call markup: the whole turn is content."""
    return ParsedTurn(text=text, content=text)


class ScriptedEnv:
    """Answers each model turn with one tool message until `turns` turns, then ends; rewards the number of
    characters of the last turn, mod 2. `sleep` seconds per step (a slow tool); `fail_at`: the step that raises."""

    tools: list[Any] = []

    def __init__(
        self, turns: int = 3, sleep: float = 0.0, fail_at: int | None = None, turn_reward: float | None = None
    ):
        self.turns, self.sleep, self.fail_at, self.turn_reward = turns, sleep, fail_at, turn_reward
        self.seen: list[str] = []

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": row["question"]}]

    def step(self, turn: ParsedTurn) -> EnvStep:
        time.sleep(self.sleep)
        self.seen.append(turn.text)
        if self.fail_at == len(self.seen):
            raise RuntimeError("the tool broke")
        counts = {"tool_calls": 1, "tool_calls/echo": 1}
        if len(self.seen) >= self.turns:
            return EnvStep(done=True, counts=counts, reward=self.turn_reward)
        return EnvStep([{"role": "tool", "content": f"result {len(self.seen)}"}], self.turn_reward, False, counts)

    def episode_reward(self) -> float | None:
        return float(len(self.seen[-1]) % 2)


ROWS = [{"question": "What is two plus three?", "answer": "5"}, {"question": "What color is the sky?", "answer": "b"}]


def write_questions(path: Path, count: int = 12) -> Path:
    """A JSONL data file of `count` rows with `question` and `answer` (what ScriptedEnv opens its episodes from)."""
    rows = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_llm(model: torch.nn.Module | None = None, **engine: Any) -> LLM:
    return LLM(model or turn_ending_model(), tiny_tokenizer(), max_model_len=512, **engine)


def runner(
    llm: LLM,
    env=lambda: ScriptedEnv(),
    max_turns: int = 4,
    max_tokens: int = 12,
    max_episode_tokens: int = 200,
    step_timeout_s: float = 30.0,
    temperature: float = 1.0,
    workers: int = 2,
) -> EpisodeRunner:
    limits = EpisodeLimits(max_turns, max_tokens, max_episode_tokens, 128, step_timeout_s)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=True)
    return EpisodeRunner(llm.engine, ChatTokens(llm.tokenizer), env, plain_parser, params, limits, workers)

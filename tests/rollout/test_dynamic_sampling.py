"""DAPO dynamic sampling decides on correctness, not on the shaped reward: a group is kept when its task
rewards (before the soft overlong penalty) differ, as DAPO's eq. 11 (0 < #correct < G) and verl's
`filter_groups.metric: acc` do; the advantage still sees the shaped reward."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from posttrain.engine import SamplingParams
from posttrain.rewards import RewardSpec
from posttrain.rollout.batch import PROMPT_KEY
from posttrain.rollout.collect import collect_rollout
from posttrain.rollout.scoring import OverlongShaping

G = 4
# max_tokens 24 and an 8-token ramp (the default dapo.overlong_cache_len): 24 -> -1, 20 -> -0.5, 10 -> 0
OVERLONG = OverlongShaping(max_tokens=24, cache_len=8, factor=1.0)


@dataclass
class _Sample:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str = "stop"
    policy_version: int = 0

    @property
    def token_policy_versions(self) -> list[int]:
        return [self.policy_version] * len(self.token_ids)


@dataclass
class _Output:
    prompt_token_ids: list[int]
    outputs: list[_Sample]


class ScriptedLLM:
    """An engine stand-in: each row's `script` lists its G samples as (text, length in tokens)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[str, int]]] = {}
        self.engine = SimpleNamespace(waiting=nullcontext)  # collect_rollout scores inside engine.waiting()

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool = False) -> list[_Output]:
        outs = []
        for prompt in prompts:
            script = self.rows[prompt[0]["content"]]
            assert len(script) == G
            outs.append(_Output([1, 2, 3], [_Sample([5] * n, text, [-0.5] * n) for text, n in script]))
        return outs


class ScriptedPrompts:
    """The rows in order, cycling."""

    reward = ""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows, self.next = rows, 0

    def sample(self, n: int) -> list[dict[str, Any]]:
        out = [dict(self.rows[(self.next + i) % len(self.rows)]) for i in range(n)]
        self.next += n
        return out


def right_answer(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 if text == "right" else 0.0 for text in completions]


def _setup(scripts: dict[str, list[tuple[str, int]]]) -> tuple[ScriptedLLM, ScriptedPrompts]:
    llm = ScriptedLLM()
    llm.rows.update(scripts)
    rows = [{PROMPT_KEY: [{"role": "user", "content": name}], "name": name} for name in scripts]
    return llm, ScriptedPrompts(rows)


def test_an_all_wrong_group_with_a_length_spread_is_dropped() -> None:
    scripts = {
        "all wrong, lengths differ": [("wrong", 24), ("wrong", 24), ("wrong", 20), ("wrong", 10)],
        "one right": [("right", 10), ("wrong", 10), ("wrong", 10), ("wrong", 10)],
    }
    llm, source = _setup(scripts)
    specs = [RewardSpec("right_answer", right_answer)]
    params = SamplingParams(n=G, max_tokens=24)
    batch, stats = collect_rollout(llm, source, 2, params, specs, OVERLONG, dynamic_sampling=False, max_refill_rounds=0)
    # The shaped rewards of the all-wrong group differ (a pure length signal) while its task rewards are equal.
    assert batch.rewards[:G].tolist() == [-1.0, -1.0, -0.5, 0.0]
    assert batch.task_rewards[:G].tolist() == [0.0] * G
    assert stats.zero_variance_frac == 0.5  # of the two groups, the all-wrong one has no correctness signal

    llm, source = _setup(scripts)
    batch, stats = collect_rollout(llm, source, 2, params, specs, OVERLONG, dynamic_sampling=True, max_refill_rounds=0)
    assert stats.dropped_groups == 1
    assert [row["name"] for row in batch.rows] == ["one right"]
    # The kept group trains on the shaped reward (no penalty at 10 tokens here: equal to the task reward).
    assert torch.equal(batch.rewards, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_a_group_with_mixed_correctness_is_kept_whatever_its_lengths() -> None:
    # 1 of 4 right, and the right one is overlong: shaped [0, 0, 0, 0] after a -1 penalty on the 1.0. The
    # shaped rewards are all equal, yet 0 < #correct < G: the group is kept, with its shaped rewards.
    scripts = {"right but long": [("right", 24), ("wrong", 10), ("wrong", 10), ("wrong", 10)]}
    llm, source = _setup(scripts)
    batch, stats = collect_rollout(
        llm,
        source,
        1,
        SamplingParams(n=G, max_tokens=24),
        [RewardSpec("right_answer", right_answer)],
        OVERLONG,
        dynamic_sampling=True,
        max_refill_rounds=0,
    )
    assert stats.dropped_groups == 0 and batch is not None and batch.num_groups == 1
    assert batch.rewards.tolist() == [0.0] * G and batch.task_rewards.tolist() == [1.0, 0.0, 0.0, 0.0]

"""Async RL in one process: the rollout side counts as idle while it waits on something outside the engine (the
reward call over a collected batch, an episode loop whose episodes all wait on their environments), so the update
takes every core meanwhile; after the wait the rollout is busy again and the update goes back to its share.

No timing: the reward / environment blocks on an event until the update side has looked."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from posttrain.engine import SamplingParams
from posttrain.envs import EnvStep, ParsedTurn
from posttrain.rewards import RewardSpec
from posttrain.rollout.batch import PROMPT_KEY
from posttrain.rollout.collect import collect_rollout
from posttrain.rollout.core_share import CoreShare
from tests.rollout.episode_helpers import ROWS, make_llm, runner

TOTAL, SHARE = 4, 2


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class _Rows:
    reward = ""

    def sample(self, n: int) -> list[dict[str, Any]]:
        return [{PROMPT_KEY: [{"role": "user", "content": f"question {i}"}]} for i in range(n)]


def _update_side_during(cores: CoreShare, wait_inside: Callable[[threading.Event, threading.Event], None]) -> list[int]:
    """Runs `wait_inside(entered, release)` as the rollout thread; the update thread (this one) claims its cores once
    the rollout is inside its wait and again after it, while the rollout is still busy. Returns both counts."""
    cores.register("update")
    entered, release, after, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def rollout() -> None:
        try:
            cores.register("rollout")
            wait_inside(entered, release)
            after.set()
            done.wait(timeout=60)  # still busy: the update must be back at its share
        except BaseException as error:  # re-raised in the test's thread
            failed.append(error)
            entered.set()
            after.set()

    thread = threading.Thread(target=rollout)
    thread.start()
    counts = []
    try:
        assert entered.wait(timeout=60)
        cores.claim()  # the update's next micro-batch, while the rollout waits
        counts.append(torch.get_num_threads())
        release.set()
        assert after.wait(timeout=60)
        cores.claim()
        counts.append(torch.get_num_threads())
    finally:
        release.set()
        done.set()
        thread.join(timeout=60)
    if failed:
        raise failed[0]
    return counts


def test_the_update_takes_every_core_while_the_rollout_scores() -> None:
    llm, cores = make_llm(), CoreShare(total=TOTAL, share=SHARE)
    llm.engine.waiting = cores.waiting
    inside: list[int] = []
    events: list[threading.Event] = []

    def slow_reward(completions: list[str], **kwargs: Any) -> list[float]:
        events[0].set()
        inside.append(torch.get_num_threads())  # the rollout thread keeps its count: a torch reward still runs
        assert events[1].wait(timeout=60)  # a remote judge answering
        return [0.0] * len(completions)

    def collect(entered: threading.Event, release: threading.Event) -> None:
        events[:] = [entered, release]
        params = SamplingParams(n=2, max_tokens=4, logprobs=True)
        batch, _ = collect_rollout(llm, _Rows(), 2, params, [RewardSpec("slow", slow_reward)], None, False, 0)
        assert batch is not None and batch.num_samples == 4

    # every core during the reward call, its share again once the rollout is busy
    assert _update_side_during(cores, collect) == [TOTAL, SHARE]
    assert inside == [SHARE]


class _SlowOpeningEnv:
    """Its construction + reset waits until released: the episode loop has no request to decode meanwhile."""

    tools: list[Any] = []
    events: list[threading.Event] = []

    def reset(self, row: Any) -> list[dict[str, Any]]:
        self.events[0].set()
        assert self.events[1].wait(timeout=60)
        return [{"role": "user", "content": row["question"]}]

    def step(self, turn: ParsedTurn) -> EnvStep:
        return EnvStep(done=True)

    def episode_reward(self) -> float | None:
        return 1.0


def test_the_update_takes_every_core_while_episodes_wait_on_their_environments() -> None:
    llm, cores = make_llm(), CoreShare(total=TOTAL, share=SHARE)
    llm.engine.waiting = cores.waiting

    def play(entered: threading.Event, release: threading.Event) -> None:
        _SlowOpeningEnv.events = [entered, release]
        episodes, _ = runner(llm, env=_SlowOpeningEnv).run(ROWS[:1], [1])
        assert episodes[0].finish in {"done", "turn_length"}

    assert _update_side_during(cores, play) == [TOTAL, SHARE]

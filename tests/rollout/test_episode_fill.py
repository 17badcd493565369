"""The episode fill (rollout/episode_fill.py): the next steps' episodes start while this step's wait on their
tools, and every step still plays exactly the episodes it would alone (its own rows, its own seeds), also when
another caller drives the engine between two collections (the fill's turns parked)."""

from __future__ import annotations

from posttrain.engine import SamplingParams
from posttrain.rollout.chat_tokens import ChatTokens
from posttrain.rollout.episode_batch import EpisodeGroups, EpisodeOptions
from posttrain.rollout.episode_fill import EpisodeFill
from posttrain.rollout.episodes import EpisodeLimits
from posttrain.rollout.tail_fill import FillPlan
from tests.rollout.episode_helpers import ScriptedEnv, make_llm, plain_parser

N, PROMPTS, STEPS = 2, 2, 3
ROWS = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(PROMPTS * STEPS + 2)]
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, n=N, logprobs=True)


def _groups(llm) -> EpisodeGroups:
    limits = EpisodeLimits(max_turns=4, max_tokens=12, max_episode_tokens=200, max_prompt_tokens=128, step_timeout_s=30)
    env = lambda: ScriptedEnv(sleep=0.02)  # noqa: E731 - a tool that takes a moment: the episodes wait together
    return EpisodeGroups(EpisodeOptions(env, plain_parser, ChatTokens(llm.tokenizer), limits, workers=16))


def _rows(step: int) -> list[dict]:
    return ROWS[PROMPTS * (step - 1) : PROMPTS * step]


def _seeds(step: int) -> list[int]:
    return [1000 * step + place * N for place in range(PROMPTS)]


def _fill(llm, groups, may_start=lambda step: True, fraction=1.0) -> tuple[EpisodeFill, list[int]]:
    drawn: list[int] = []

    def draw(step: int, n: int) -> list[dict]:
        drawn.append(step)
        return _rows(step)[:n]

    fill = EpisodeFill(groups, llm, FillPlan(PARAMS, PROMPTS, draw, lambda s: 1000 * s, may_start, STEPS, fraction))
    return fill, drawn


def test_each_step_plays_its_own_episodes_whether_started_ahead_or_not() -> None:
    llm = make_llm()
    alone = [_groups(llm)(llm, _rows(s), PARAMS, _seeds(s)).completion_ids for s in range(1, STEPS + 1)]
    groups = _groups(llm)
    fill, drawn = _fill(llm, groups)
    played, admitted_steps = [], []
    try:
        for step in range(1, STEPS + 1):
            admitted = fill.take(step)
            if admitted is not None:
                admitted_steps.append(step)
                batch = admitted.finish(PARAMS)
            else:
                batch = fill(llm, _rows(step), PARAMS, _seeds(step))
            played.append(batch.completion_ids)
            assert [row["question"] for row in batch.rows] == [row["question"] for row in _rows(step)]
            with fill.parked():  # the trainer's evaluation between two collections: the engine to it alone
                other = _groups(llm)(llm, ROWS[-2:], PARAMS, [7, 9])
            assert other.num_groups == 2
    finally:
        fill.close()
    assert admitted_steps == [2, 3] and drawn == [2, 3]  # started ahead, drawn once each, in order
    assert played == alone
    assert len(groups.take_log().episodes) == PROMPTS * N * STEPS


def test_no_step_starts_ahead_past_the_bound() -> None:
    llm = make_llm()
    fill, drawn = _fill(llm, _groups(llm), may_start=lambda step: step <= 1)
    try:
        fill.take(1)
        fill(llm, _rows(1), PARAMS, _seeds(1))
        assert fill.take(2) is None and drawn == []
    finally:
        fill.close()


def test_a_step_starts_ahead_only_once_few_enough_episodes_are_generating() -> None:
    # fraction ~0: only while no episode has a turn in the engine (all of them wait on their tools)
    llm = make_llm()
    fill, _ = _fill(llm, _groups(llm), fraction=1e-9)
    try:
        fill.take(1)
        fill(llm, _rows(1), PARAMS, _seeds(1))
        assert fill.log.steps and all(busy == 0 for busy in fill.log.unfinished_before)
    finally:
        fill.close()
    fill, _ = _fill(llm, _groups(llm), fraction=1.0)
    try:
        fill.take(1)
        fill(llm, _rows(1), PARAMS, _seeds(1))
        assert fill.log.steps[0] == 2 and fill.log.unfinished_before[0] > 0  # at once: step 1's turns were running
    finally:
        fill.close()

"""compute_rewards: weights, None/exception -> unscorable (NaN), async functions, errors named up front."""

import asyncio
import logging
import math

import pytest
import torch

from posttrain.rewards import RewardError, RewardSpec, compute_rewards, numeric_match

PROMPTS = ["a", "b", "c"]
COMPLETIONS = ["1", "2", "3"]


def const(values):
    def fn(prompts, completions, **kwargs):
        return list(values)

    return fn


def nan_equal(tensor, expected):
    assert tensor.dtype == torch.float32 and tensor.shape == (len(expected),)
    for got, want in zip(tensor.tolist(), expected):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want), (tensor, expected)


def test_weighted_sum_and_per_function():
    specs = [RewardSpec("a", const([1.0, 0.0, 1.0]), 1.0), RewardSpec("b", const([0.5, 0.5, -1.0]), -2.0)]
    result = compute_rewards(specs, PROMPTS, COMPLETIONS, {})
    nan_equal(result.total, [0.0, -1.0, 3.0])
    nan_equal(result.per_function["a"], [1.0, 0.0, 1.0])
    nan_equal(result.per_function["b"], [0.5, 0.5, -1.0])  # raw, unweighted
    assert result.num_unscorable == 0 and result.errors == []
    assert result.metrics()["reward/mean"] == pytest.approx(2 / 3)


def test_none_from_any_weighted_function_makes_the_sample_unscorable():
    specs = [RewardSpec("a", const([1.0, None, 1.0])), RewardSpec("b", const([1.0, 1.0, float("nan")]))]
    result = compute_rewards(specs, PROMPTS, COMPLETIONS)
    nan_equal(result.total, [2.0, float("nan"), float("nan")])
    nan_equal(result.per_function["a"], [1.0, float("nan"), 1.0])
    assert result.num_unscorable == 2
    assert result.scorable.tolist() == [True, False, False]


def test_weight_zero_function_is_reported_but_not_in_total():
    specs = [RewardSpec("task", const([1.0, 0.0, 1.0])), RewardSpec("metric_only", const([None, 7.0, 7.0]), 0.0)]
    result = compute_rewards(specs, PROMPTS, COMPLETIONS)
    nan_equal(result.total, [1.0, 0.0, 1.0])
    nan_equal(result.per_function["metric_only"], [float("nan"), 7.0, 7.0])
    assert result.num_unscorable == 0


def test_exception_marks_the_batch_unscorable_for_that_function_and_is_logged_once(caplog):
    def broken(prompts, completions, **kwargs):
        raise ConnectionError("judge server down")

    specs = [RewardSpec("ok", const([1.0, 1.0, 1.0])), RewardSpec("judge", broken)]
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.combine"):
        result = compute_rewards(specs, PROMPTS, COMPLETIONS)
    nan_equal(result.total, [float("nan")] * 3)
    nan_equal(result.per_function["ok"], [1.0, 1.0, 1.0])
    nan_equal(result.per_function["judge"], [float("nan")] * 3)
    assert result.num_unscorable == 3
    assert result.errors == ["judge: ConnectionError: judge server down"]
    records = [r for r in caplog.records if "judge" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None


def test_a_spec_that_keeps_raising_is_logged_once_and_still_reported_every_batch(caplog):
    calls = []

    async def broken(prompts, completions, **kwargs):  # async too: failures come back from the gather
        calls.append(1)
        raise ConnectionError(f"judge server down ({len(calls)})")

    specs = [RewardSpec("ok", const([1.0, 1.0, 1.0])), RewardSpec("judge", broken)]
    with caplog.at_level(logging.DEBUG, logger="posttrain.rewards.combine"):
        results = [compute_rewards(specs, PROMPTS, COMPLETIONS) for _ in range(3)]  # e.g. two steps, one eval
    assert [r.errors for r in results] == [[f"judge: ConnectionError: judge server down ({n})"] for n in (1, 2, 3)]
    assert all(r.num_unscorable == 3 for r in results)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "judge server down (1)" in warned[0].getMessage() and warned[0].exc_info
    assert sum("raised again" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.combine"):  # new specs: a new run
        compute_rewards([RewardSpec("judge", broken)], PROMPTS, COMPLETIONS)
    assert len(caplog.records) == 1


def test_async_functions_run_concurrently():
    first_started, second_started = asyncio.Event(), asyncio.Event()

    async def first(prompts, completions, **kwargs):  # each waits for the other to have started:
        first_started.set()  # sequential awaiting would time out here
        await asyncio.wait_for(second_started.wait(), timeout=5)
        return [1.0] * len(completions)

    async def second(prompts, completions, **kwargs):
        second_started.set()
        await asyncio.wait_for(first_started.wait(), timeout=5)
        return [2.0] * len(completions)

    async def failing(prompts, completions, **kwargs):
        raise ValueError("bad batch")

    specs = [
        RewardSpec("first", first),
        RewardSpec("sync", const([0.0, 0.0, 1.0])),
        RewardSpec("second", second),
        RewardSpec("failing", failing, 0.0),
    ]
    result = compute_rewards(specs, PROMPTS, COMPLETIONS)
    nan_equal(result.total, [3.0, 3.0, 4.0])
    nan_equal(result.per_function["failing"], [float("nan")] * 3)
    assert result.errors == ["failing: ValueError: bad batch"]


def test_async_function_inside_a_running_event_loop():
    async def judged(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(c) for c in completions]

    async def caller():  # a trainer that is itself async
        return compute_rewards([RewardSpec("judged", judged)], PROMPTS, COMPLETIONS)

    nan_equal(asyncio.run(caller()).total, [1.0, 2.0, 3.0])


def test_columns_reach_functions_and_trl_style_signatures_work():
    seen = {}

    def trl_style(completions, answer, **kwargs):  # no `prompts` parameter: it arrives in **kwargs
        seen.update(kwargs)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    columns = {"answer": ["1", "5", "3"], "completion_ids": [[1], [2, 2], [3]]}
    result = compute_rewards(
        [RewardSpec("trl", trl_style), RewardSpec("match", numeric_match)], PROMPTS, COMPLETIONS, columns
    )
    nan_equal(result.total, [2.0, 0.0, 2.0])
    assert seen["prompts"] == PROMPTS and seen["completion_ids"] == [[1], [2, 2], [3]]


def test_conversational_batch():
    prompts = [[{"role": "user", "content": "What is 1 plus 1?"}]] * 2
    completions = [[{"role": "assistant", "content": "It is 2."}], [{"role": "assistant", "content": "3"}]]
    result = compute_rewards([RewardSpec("match", numeric_match)], prompts, completions, {"answer": ["2", "2"]})
    nan_equal(result.total, [1.0, 0.0])


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0, 2.0], r"reward 'bad' returned 2 values for a batch of 3"),
        (1.0, r"reward 'bad' returned a float; expected a list of 3 floats"),
        ([1.0, "2", 3.0], r"reward 'bad' returned a str at index 1"),
        ([1.0, float("inf"), 3.0], r"reward 'bad' returned inf at index 1; rewards must be finite"),
    ],
)
def test_bad_return_values_name_the_function(returned, message):
    with pytest.raises(RewardError, match=message):
        compute_rewards([RewardSpec("bad", lambda prompts, completions, **kw: returned)], PROMPTS, COMPLETIONS)


def test_tensor_and_scalar_tensor_returns_are_accepted():
    specs = [
        RewardSpec("t", lambda prompts, completions, **kw: torch.tensor([1.0, 2.0, 3.0])),
        RewardSpec("s", lambda prompts, completions, **kw: [torch.tensor(1.0), None, 0]),
    ]
    nan_equal(compute_rewards(specs, PROMPTS, COMPLETIONS).total, [2.0, float("nan"), 3.0])


def test_bad_signature_fails_before_any_function_runs():
    calls = []

    def counted(prompts, completions, **kwargs):
        calls.append(1)
        return [1.0] * len(completions)

    def needs_solution(prompts, completions, solution, **kwargs):
        return [1.0] * len(completions)

    specs = [RewardSpec("counted", counted), RewardSpec("needs_solution", needs_solution)]
    with pytest.raises(
        RewardError,
        match=r"reward 'needs_solution' .* required parameter 'solution' is not one of "
        r"the arguments it gets \(prompts, completions, answer\)",
    ):
        compute_rewards(specs, PROMPTS, COMPLETIONS, {"answer": ["1", "2", "3"]})
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompts": ["a"]}, "1 prompts but 3 completions"),
        ({"columns": {"answer": ["1"]}}, "column 'answer' has 1 values for a batch of 3"),
        ({"columns": {"answer": "123"}}, "column 'answer' must be a list aligned with the batch"),
        ({"columns": {"prompts": [1, 2, 3]}}, "column 'prompts' clashes"),
        ({"specs": []}, "no reward functions given"),
        ({"specs": [RewardSpec("a", const([1, 1, 1])), RewardSpec("a", const([1, 1, 1]))]}, "repeated: a"),
        ({"specs": [RewardSpec("a", const([1, 1, 1]), 0.0)]}, "every reward has weight 0"),
    ],
)
def test_batch_validation(kwargs, message):
    call = {
        "specs": [RewardSpec("a", const([1, 1, 1]))],
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "columns": {},
        **kwargs,
    }
    with pytest.raises(RewardError, match=message):
        compute_rewards(**call)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "", "fn": len}, "name must be a non-empty string"),
        ({"name": "x", "fn": 3}, "fn is a int, not callable"),
        ({"name": "x", "fn": len, "weight": float("nan")}, "weight must be a finite number"),
        ({"name": "x", "fn": len, "weight": "1"}, "weight must be a finite number"),
    ],
)
def test_reward_spec_validation(kwargs, message):
    with pytest.raises(RewardError, match=message):
        RewardSpec(**kwargs)

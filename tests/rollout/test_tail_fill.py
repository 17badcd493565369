"""The tail fill (rollout/tail_fill.py): the next step's first round joins the engine while the current step still
generates, and each step's batch is collected by request: exactly its own prompts, with the seeds (and so the
samples) it gets without the fill."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.engine import SamplingParams
from posttrain.rewards import RewardSpec
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch
from posttrain.rollout.collect import collect_rollout
from posttrain.rollout.tail_fill import FillPlan, TailFill
from tests.rollout.episode_helpers import make_llm

PROMPTS, N = 3, 2
PARAMS = SamplingParams(n=N, max_tokens=10, logprobs=True)


class _Rows:
    """Distinct prompts in order."""

    reward = ""

    def __init__(self) -> None:
        self.next = 0

    def sample(self, n: int) -> list[dict[str, Any]]:
        rows = [{PROMPT_KEY: [{"role": "user", "content": f"question {self.next + i}"}]} for i in range(n)]
        self.next += n
        return rows


def _length(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(text)) for text in completions]


def _collect(llm: Any, source: _Rows, step: int, **kwargs: Any) -> RolloutBatch:
    batch, _ = collect_rollout(
        llm, source, PROMPTS, PARAMS, [RewardSpec("length", _length)], None, False, 0, seed_base=step * 1000, **kwargs
    )
    assert batch is not None
    return batch


def _fill(llm: Any, source: _Rows, fraction: float, may_start=lambda step: True) -> TailFill:
    plan = FillPlan(PARAMS, PROMPTS, lambda step, n: source.sample(n), lambda step: step * 1000, may_start, 3, fraction)
    return TailFill(llm, plan)


def test_the_next_step_joins_the_engine_before_this_step_ends_and_each_step_keeps_its_own_prompts() -> None:
    llm, source = make_llm(), _Rows()
    in_engine: list[set[str]] = []  # the request ids in the engine at every engine step
    llm.engine.before_step.append(lambda: in_engine.append(set(llm.engine.requests)))
    fill = _fill(llm, source, fraction=1.0)

    assert fill.take(1) is None
    first = _collect(llm, source, 1, generate=fill)
    assert fill.log.steps == [2]
    assert fill.log.unfinished_before[0] >= 1  # submitted while step 1 still generated
    admitted = fill.take(2)
    assert admitted is not None and admitted.step == 2 and len(admitted.rows) == PROMPTS
    # ... and decoded along: an engine step ran with requests of both steps in it
    step_one = set(in_engine[0]) - set(admitted.request_ids)
    assert any(ids & step_one and ids & set(admitted.request_ids) for ids in in_engine)

    second = _collect(llm, source, 2, generate=fill, admitted=admitted)
    assert fill.log.steps == [2, 3]  # step 3 joined step 2's tail in turn
    fill.close()
    assert not llm.engine.has_unfinished_requests()  # the round no collection took was dropped

    # Without the fill: the same prompts per step, the same seeds, so the same samples (the weights never changed;
    # a seeded sample depends on its logits only, engine/sampler.py).
    plain_llm, plain_source = make_llm(), _Rows()
    for batch, step in ((first, 1), (second, 2)):
        plain = _collect(plain_llm, plain_source, step)
        assert batch.rows == plain.rows
        assert batch.prompt_ids == plain.prompt_ids
        assert batch.completion_ids == plain.completion_ids
        assert batch.token_versions == plain.token_versions


def test_no_fill_while_the_bound_holds_the_next_step_back_or_the_tail_is_long() -> None:
    llm, source = make_llm(), _Rows()
    held = _fill(llm, source, fraction=1.0, may_start=lambda step: False)
    held.take(1)
    _collect(llm, source, 1, generate=held)
    assert held.log.steps == [] and source.next == PROMPTS  # nothing drawn for step 2

    half = _fill(llm, source, fraction=0.5)
    half.take(1)
    lengths = [len(ids) for ids in _collect(llm, source, 1, generate=half).completion_ids]
    assert len(set(lengths)) > 1  # the samples end apart (this model and these seeds): the step has a tail
    assert half.log.steps == [2] and half.log.unfinished_before[0] <= PROMPTS * N // 2  # joined in the tail only
    half.close()

    tiny = _fill(llm, source, fraction=1e-9)  # only once no sample of the step is left: never inside its collection
    tiny.take(1)
    _collect(llm, source, 1, generate=tiny)
    assert tiny.log.steps == []


def test_a_round_submitted_ahead_needs_one_process_and_no_dynamic_sampling() -> None:
    llm, source = make_llm(), _Rows()
    fill = _fill(llm, source, fraction=1.0)
    fill.take(1)
    _collect(llm, source, 1, generate=fill)
    with pytest.raises(ValueError, match="one process and no dynamic sampling"):
        collect_rollout(llm, source, PROMPTS, PARAMS, [], None, True, 0, admitted=fill.take(2))
    fill.close()

"""Adaptive draft length (posttrain/engine/speculative/draft_length.py): the count with the most tokens per unit of
step cost, the acceptance and cost estimates it reads, and the engine checking fewer drafts where they are rejected
and as many as before where they are accepted, its greedy output unchanged."""

from __future__ import annotations

import pytest

from posttrain.engine import SamplingParams
from posttrain.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from posttrain.engine.speculative.draft_length import (
    DEFAULT_ROW_COST,
    MIN_TIMED,
    Acceptance,
    DraftLength,
    guessed_step_cost,
)
from tests.engine.test_engine import PROMPTS
from tests.engine.test_speculative import LOOPING, REPEATING_PROMPT, VARIED, token_ids
from tests.engine.tiny import make_llm, tiny_model


class _EvenRows(DraftLength):
    """Every draft row costs `row_cost` of a plain step."""

    def __init__(self, row_cost: float) -> None:
        super().__init__()
        self.row_cost = row_cost

    def step_cost(self, num_seqs: int, rows: int) -> float:
        return 1.0 + self.row_cost * rows


def best_count(rate: float, row_cost: float, most: int) -> int:
    """The count one sequence checks of `most` drafts accepted at `rate`, when every row costs `row_cost`."""
    length, checked = _EvenRows(row_cost), 1e6
    length.acceptance[1] = Acceptance(accepted=rate * (checked + 2) - 1, checked=checked)  # rate = `rate`
    return length.choose([(1, most)], num_seqs=1)[0]


def test_best_count_weighs_expected_tokens_against_row_cost() -> None:
    assert best_count(0.0, 0.1, 4) == 0  # never accepted: a draft row buys nothing
    assert best_count(0.13, 0.3, 4) == 0  # 1.13 tokens for 1.3 steps' time
    assert best_count(0.13, 0.05, 4) == 1  # cheap rows: one draft pays (1.13 / 1.05), a second does not
    # p = 0.5, c = 0.1: k = 1, 2, 3 give 1.364, 1.458, 1.442 tokens per plain step
    assert best_count(0.5, 0.1, 4) == 2
    assert best_count(0.95, 0.1, 4) == 4
    assert best_count(0.95, 0.1, 2) == 2  # never more than proposed
    assert best_count(1.0, 0.0, 3) == 3


def test_acceptance_counts_each_accepted_draft_and_the_first_rejected() -> None:
    length = DraftLength()
    length.checked(kind=2, drafts=4, accepted=1)  # accepted, rejected, (two never reached)
    stats = length.acceptance[2]
    assert (stats.accepted, stats.checked) == (1, 2)
    length.checked(kind=2, drafts=3, accepted=3)  # all accepted: no rejection to count
    assert (stats.accepted, stats.checked) == (4, 5)
    assert stats.rate == pytest.approx(5 / 7)  # with the prior of one accepted and one rejected


def test_step_cost_comes_from_the_engines_decode_steps() -> None:
    length = DraftLength()
    assert length.step_cost(1, 4) == pytest.approx(1 + 4 * DEFAULT_ROW_COST)  # nothing timed yet: the guess
    length.step_took(1, 0, 0.010)
    length.step_took(1, 4, 0.050)  # one check, paying a first call's costs: not trusted alone
    assert length.step_cost(1, 4) == pytest.approx(1 + 4 * DEFAULT_ROW_COST)
    for _ in range(100):  # the averages forget the slow first check
        length.step_took(1, 0, 0.010)
        length.step_took(1, 1, 0.013)  # a checking step's fixed cost: the first row costs 0.3 of a plain step
        length.step_took(1, 4, 0.016)  # and each further one 0.1
    assert length.step_cost(1, 1) == pytest.approx(1.3, rel=1e-3)
    assert length.step_cost(1, 4) == pytest.approx(1.6, rel=1e-3)
    assert length.step_cost(1, 2) == pytest.approx(1.2)  # not timed: still the guess, so it gets tried
    assert length.step_cost(8, 4) == pytest.approx(1 + 0.4 / 1.7)  # another batch size: its own times (the guess)
    assert length.step_cost(1, 0) == 1.0


def test_choose_reads_the_measured_costs_and_the_steps_other_drafts() -> None:
    length = DraftLength()
    for _ in range(MIN_TIMED):
        for rows, seconds in ((0, 0.010), (1, 0.013), (2, 0.014), (3, 0.015), (4, 0.016)):
            length.step_took(1, rows, seconds)
    for _ in range(20):
        length.checked(kind=2, drafts=4, accepted=4)  # p near 1
        length.checked(kind=1, drafts=4, accepted=0)  # p near 0
    assert length.choose([(2, 4)], num_seqs=1) == [4]  # ~4.6 tokens for 1.6 steps
    assert length.choose([(1, 4)], num_seqs=1) == [0]
    assert length.choose([(5, 0), (2, 4)], num_seqs=2) == [0, 4]  # nothing proposed: nothing checked
    assert 5 not in length.acceptance
    length.acceptance[3] = Acceptance(accepted=1, checked=8)  # p = 0.2
    # p = 0.2 under these costs: k = 1 gives 1.2 tokens for 1.3 steps; were every row 0.1, one draft would pay
    assert length.choose([(3, 4)], num_seqs=1) == [0]
    assert best_count(0.2, 0.1, 4) == 1


def test_rejected_kinds_stop_drafting_and_are_tried_again_later() -> None:
    length = DraftLength()
    assert length.choose([(1, 4)], num_seqs=1)[0] > 0  # the prior (p = 0.5) pays at the guessed cost
    for _ in range(30):
        length.drafting_step()
        length.checked(kind=1, drafts=4, accepted=0)
    assert length.choose([(1, 4), (3, 4)], num_seqs=2)[0] == 0
    assert length.choose([(3, 4)], num_seqs=1)[0] > 0  # a longer match is its own kind
    steps = 0
    while length.choose([(1, 4)], num_seqs=1)[0] == 0:  # not checked: the old rejections fade
        length.drafting_step()
        steps += 1
    assert 20 < steps < 200


@pytest.fixture
def row_cost_01(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft rows cost the untimed guess (a tenth of a step at batch 1), whatever the clock says: the tiny model's
    steps are mostly Python (a row there costs about a whole step, and drafting would stop at once), and timing
    makes tests flaky."""
    monkeypatch.setattr(DraftLength, "step_cost", lambda self, num_seqs, rows: guessed_step_cost(num_seqs, rows))


def _generate(seed: int, prompts: list[list[int]], adaptive: bool, max_tokens: int = 60):
    llm = make_llm(tiny_model(seed), speculative={"method": "ngram", "num_tokens": 4, "adaptive": adaptive})
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return token_ids(out), llm.stats()


def test_the_engine_checks_fewer_drafts_where_they_are_rejected(row_cost_01: None) -> None:
    # At temperature 2 the tiny model's next token is nearly uniform: a looked-up token is rarely drawn.
    params = SamplingParams(temperature=2.0, max_tokens=60, ignore_eos=True, seed=1)
    stats = {}
    for adaptive in (False, True):
        llm = make_llm(tiny_model(VARIED), speculative={"method": "ngram", "num_tokens": 4, "adaptive": adaptive})
        outputs = llm.generate(PROMPTS[:4], params)
        assert all(len(ids) == 60 for ids in token_ids(outputs))
        stats[adaptive] = llm.stats()
    assert stats[False]["spec_acceptance_rate"] < 0.1  # the premise: these drafts are mostly wrong
    assert stats[True]["spec_draft_tokens"] < 0.3 * stats[False]["spec_draft_tokens"]
    assert stats[True]["spec_skipped_draft_tokens"] > stats[True]["spec_draft_tokens"]
    assert stats[False]["spec_skipped_draft_tokens"] == 0


def test_the_engine_keeps_checking_drafts_where_they_are_accepted(row_cost_01: None) -> None:
    fixed_ids, fixed = _generate(LOOPING, [REPEATING_PROMPT], adaptive=False, max_tokens=40)
    adaptive_ids, adaptive = _generate(LOOPING, [REPEATING_PROMPT], adaptive=True, max_tokens=40)
    assert adaptive_ids == fixed_ids
    assert adaptive["spec_acceptance_rate"] > 0.8
    assert adaptive["steps"] <= fixed["steps"] + 2  # ~4 drafts a step as before, not one at a time


def test_adaptive_must_be_a_bool() -> None:
    with pytest.raises(SpeculativeConfigError, match="speculative.adaptive='yes': must be true or false"):
        SpeculativeConfig(adaptive="yes")

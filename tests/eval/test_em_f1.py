"""Exact match and token F1: SQuAD normalisation and hand-computed scores, references as lists, --extract,
and the whole evaluation on canned completions."""

from __future__ import annotations

import pytest

from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError
from posttrain.eval import Sampling, evaluate_em_f1, exact_match, normalize_answer, token_f1
from posttrain.eval.em_f1 import compile_extract, extract_answer, score_em_f1
from tests.eval.fakes import FakeLLM, chat


def test_normalisation():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("  an apple, a pear & THE plum. ") == "apple pear plum"
    assert normalize_answer("Theory") == "theory"  # articles only as whole words
    assert normalize_answer("...") == ""


def test_exact_match_and_f1_by_hand():
    assert exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
    assert exact_match("Eiffel", "eiffel tower") == 0.0
    # prediction "eiffel tower in paris" (4 tokens) vs "eiffel tower" (2): 2 shared; P = 2/4, R = 2/2, F1 = 2/3
    assert token_f1("The Eiffel Tower in Paris", "the Eiffel Tower") == pytest.approx(2 / 3)
    # repeated tokens count once per occurrence: "a b b" vs "b b b c" -> (b: 2 shared); P = 2/2, R = 2/4
    assert token_f1("x b b", "b b b c") == pytest.approx(2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4))
    assert token_f1("paris", "london") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    assert token_f1("paris", "the") == 0.0


def test_best_over_several_references_and_extraction():
    ems, f1s, no_match = score_em_f1(
        ["Answer: Paris, France", "I think it is Rome", "Answer: the moon"],
        [["London", "Paris, France"], ["rome"], []],
        extract=r"Answer:\s*(.*)",
    )
    assert ems == [1.0, 0.0, None]  # the second has no "Answer:" -> empty prediction; the third no reference
    assert f1s == [1.0, 0.0, None]
    assert no_match == 1
    assert extract_answer("#### 3 then #### 42", compile_extract(r"####\s*(?P<answer>\d+)")) == "42"  # last match
    assert extract_answer("the answer is 7", compile_extract(r"\d+")) == "7"  # no group: the whole match
    with pytest.raises(PosttrainError, match=r"--extract '\(' is not a valid regular expression"):
        compile_extract("(")


def test_evaluation_on_canned_completions():
    rows = [
        {"prompt": chat("capital of France?"), "answer": ["Paris", "paris, france"]},
        {"prompt": chat("largest planet?"), "answer": "Jupiter"},
        {"prompt": chat("unknown"), "answer": None},
    ]
    llm = FakeLLM(
        {"capital of France?": ["It is Paris, France."], "largest planet?": ["Saturn or Jupiter"], "unknown": ["?"]}
    )
    result = evaluate_em_f1(llm, rows, extract=r"(?:It is )?(.*)")
    # 1: "Paris, France." -> EM 1 vs the second reference; 2: "Saturn or Jupiter" vs "Jupiter": P 1/3, R 1 -> F1 1/2
    assert result.exact_match == pytest.approx(1 / 2)
    assert result.f1 == pytest.approx((1.0 + 0.5) / 2)
    assert (result.samples, result.scorable, result.unscorable, result.no_match) == (3, 2, 1, 0)
    assert result.records[1]["references"] == ["Jupiter"]


def test_bad_references_name_the_row():
    rows = [{"prompt": chat("q"), "answer": {"text": "x"}}]
    with pytest.raises(DataError, match=r"qa.jsonl:7: answer \{'text': 'x'\} is a dict"):
        evaluate_em_f1(FakeLLM({"q": ["x"]}), rows, locations=["qa.jsonl:7"])
    with pytest.raises(DataError, match=r"row 0: no 'answer' \(reference\) column"):
        evaluate_em_f1(FakeLLM({"q": ["x"]}), [{"prompt": chat("q")}])
    with pytest.raises(PosttrainError, match="identical greedy samples"):
        evaluate_em_f1(FakeLLM({"q": ["x"]}), [{"prompt": chat("q"), "answer": "x"}], sampling=Sampling(n=2))

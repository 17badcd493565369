"""Built-in answer rewards on hand-made cases: number formats, 0.0 (wrong / no answer) vs None (no reference)."""

from decimal import Decimal

import pytest

from posttrain.rewards import answers
from posttrain.rewards.answers import boxed, gsm8k, last_boxed, last_number, numeric_match, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("47 + 38 = 85", "85"),
        ("The answer is 85.", "85"),
        ("It costs $1,234 in total", "1234"),
        ("Total: 1,234,567.", "1234567"),
        ("The temperature is -12 degrees", "-12"),
        ("x = \u22125", "-5"),  # unicode minus
        ("about 3.14 or so", "3.14"),
        ("it is -$4.50", "-4.50"),
        ("**85**", "85"),
        ("47-38 leaves 9", "9"),  # a minus between numbers is subtraction, not a sign
        ("1, 2, 3", "3"),  # a list, not a thousands separator
        ("1,2345", "2345"),  # not a valid thousands group: two numbers
        ("H2O and v1.2 only", None),  # digits inside words are not numbers
        ("no number here", None),
        ("", None),
        ("85th place, then 0.5", "0.5"),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == (None if expected is None else Decimal(expected))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("85", "85"),
        (" $1,234 ", "1234"),
        ("-7.", "-7"),
        ("0.50", "0.5"),
        ("85 apples", None),
        ("1/2", None),
        ("", None),
    ],
)
def test_parse_number_is_strict(text, expected):
    assert parse_number(text) == (None if expected is None else Decimal(expected))


def test_numeric_match_scores_and_semantics():
    completions = ["47 plus 38 is 85.", "I think 84", "no idea", "$1,234", "85.0", "the sum is 85"]
    answers_ = ["85", "85", "85", 1234, 85, None]
    # right, wrong, no number = wrong (0.0), int reference, 85.0 == 85, missing reference = unscorable (None)
    assert numeric_match([""] * 6, completions, answer=answers_) == [1.0, 0.0, 0.0, 1.0, 1.0, None]


def test_numeric_match_non_numeric_reference_is_unscorable_and_wrong_type_raises():
    assert numeric_match(["p"], ["85"], answer=["eighty-five"]) == [None]
    assert numeric_match(["p"], ["85"], answer=[""]) == [None]
    with pytest.raises(TypeError, match=r"answer\[0\] is a list"):
        numeric_match(["p"], ["85"], answer=[[85]])


def test_numeric_match_conversational_completions():
    completions = [
        [{"role": "assistant", "content": "The answer is 85."}],
        [{"role": "assistant", "content": [{"type": "text", "text": "It is 86"}]}],
    ]
    prompts = [[{"role": "user", "content": "What is 47 plus 38?"}]] * 2
    assert numeric_match(prompts, completions, answer=["85", "85"]) == [1.0, 0.0]


def test_gsm8k_reference_and_completion_extraction():
    reference = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    completions = [
        "48 + 24 = 72\n#### 72",
        "#### 72\nActually wait, 73 too",  # an explicit #### answer wins over later numbers
        "so the answer is 72",  # no ####: last number
        "#### 71",
        "I cannot solve this",
    ]
    assert gsm8k([""] * 5, completions, answer=[reference] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    references = ["#### 1,200", "#### -3", "#### "]  # the last has no number: unscorable
    assert gsm8k(["", "", ""], ["#### 1,200", "#### -3", "5"], answer=references) == [1.0, 1.0, None]
    assert gsm8k([""], ["#### 9"], answer=["9"]) == [1.0]  # a bare number reference is accepted too


def test_last_boxed_nested_and_unbalanced():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("nothing") is None


BOXED_CASES = [
    (r"so \boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),  # equal after normalisation
    (r"\boxed{ 42 }", "42", 1.0),
    (r"\boxed{42^\circ}", r"42", 1.0),
    (r"\boxed{43}", "42", 0.0),
    ("42 without a box", "42", 0.0),  # no \boxed answer: wrong
    (r"\boxed{3}", r"The answer is \boxed{3}.", 1.0),  # reference given with its own \boxed
]


@pytest.mark.parametrize("completion, reference, expected", BOXED_CASES)
def test_boxed_common_cases(completion, reference, expected):
    assert boxed([""], [completion], answer=[reference]) == [expected]


def test_boxed_missing_reference_is_unscorable():
    assert boxed(["", ""], [r"\boxed{1}", r"\boxed{1}"], answer=[None, "  "]) == [None, None]


def test_boxed_uses_math_verify_for_equivalence():
    pytest.importorskip("math_verify")
    answers.math_verify_backend.cache_clear()
    completions = [r"\boxed{0.5}", r"\boxed{1+x^2}", r"\boxed{\frac{\pi}{2}}", r"\boxed{0.3333}"]
    references = [r"\frac{1}{2}", "x^2+1", r"\pi/2", r"\frac{1}{3}"]
    assert boxed([""] * 4, completions, answer=references) == [1.0, 1.0, 1.0, 0.0]


def test_boxed_without_math_verify_falls_back_to_strings(monkeypatch):
    monkeypatch.setattr(answers, "math_verify_backend", lambda: None)
    completions = [r"\boxed{0.5}", r"\boxed{\text{east}}", r"\boxed{0.50}"]
    # 0.5 vs \frac12 needs symbolic equivalence, which the fallback does not have: wrong
    assert boxed([""] * 3, completions, answer=[r"\frac{1}{2}", "east", "0.5"]) == [0.0, 1.0, 1.0]


def test_boxed_math_verify_failure_is_unscorable_not_zero(monkeypatch):
    class Broken:
        @staticmethod
        def parse(*args, **kwargs):
            raise RuntimeError("parser crashed")

    monkeypatch.setattr(answers, "math_verify_backend", lambda: Broken)
    assert boxed([""], [r"\boxed{0.5}"], answer=[r"\frac{1}{2}"]) == [None]

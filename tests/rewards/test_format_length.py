"""format_reward, length_penalty and DAPO's overlong_penalty."""

import pytest

from posttrain.rewards import RewardError, format_reward, length_penalty, overlong_penalty
from posttrain.rewards.format import THINK_ANSWER_PATTERN

THINK = r"<think>.*</think>\s*<answer>.*</answer>"


def test_format_fullmatch_and_search():
    completions = [
        "<think>47+38</think>\n<answer>85</answer>",
        "  <think>multi\nline</think><answer>85</answer>\n",  # surrounding whitespace stripped, . spans lines
        "<answer>85</answer>",
        "preamble <think>x</think><answer>85</answer>",
    ]
    assert format_reward(THINK)([""] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
    assert format_reward(THINK, mode="search")([""] * 4, completions) == [1.0, 1.0, 0.0, 1.0]
    assert format_reward(THINK_ANSWER_PATTERN)([""], completions[:1]) == [1.0]


def test_format_conversational():
    completions = [
        [{"role": "assistant", "content": "<think>a</think><answer>1</answer>"}],
        [{"role": "assistant", "content": "1"}],
    ]
    assert format_reward(THINK)([[{"role": "user", "content": "q"}]] * 2, completions) == [1.0, 0.0]


def test_format_bad_regex_and_mode_are_clear_errors():
    with pytest.raises(RewardError, match=r"invalid regular expression '<think>\('"):
        format_reward("<think>(")
    with pytest.raises(RewardError, match="mode must be one of fullmatch, search"):
        format_reward("x", mode="match")


def test_overlong_penalty_follows_dapo():
    fn = overlong_penalty(max_len=20, cache_len=4)
    ids = [[0] * n for n in (10, 16, 17, 18, 20, 21, 40)]
    assert fn([""] * 7, ["x"] * 7, completion_ids=ids) == pytest.approx([0, 0, -0.25, -0.5, -1.0, -1.0, -1.0])
    half = overlong_penalty(20, 4, penalty_factor=0.5)
    assert half([""], ["x"], completion_ids=[[0] * 18]) == pytest.approx([-0.25])


def test_length_rewards_fall_back_to_characters_without_completion_ids():
    fn = overlong_penalty(max_len=10, cache_len=5)
    assert fn(["", ""], ["abcde", "abcdefgh"]) == pytest.approx([0.0, -0.6])
    chat = [[{"role": "assistant", "content": "abcdefgh"}]]
    assert fn([[{"role": "user", "content": "q"}]], chat) == pytest.approx([-0.6])


def test_length_penalty_is_linear_and_capped():
    fn = length_penalty(max_len=10, penalty_factor=2.0)
    ids = [[], [0] * 5, [0] * 10, [0] * 30]
    assert fn([""] * 4, ["x"] * 4, completion_ids=ids) == pytest.approx([0.0, -1.0, -2.0, -2.0])


@pytest.mark.parametrize(
    "factory, kwargs, message",
    [
        (overlong_penalty, {"max_len": 10, "cache_len": 11}, "need cache_len <= max_len"),
        (overlong_penalty, {"max_len": 0, "cache_len": 0}, "max_len must be a positive integer"),
        (length_penalty, {"max_len": 2.5}, "max_len must be a positive integer"),
        (length_penalty, {"max_len": 8, "penalty_factor": float("nan")}, "penalty_factor must be a finite number"),
    ],
)
def test_length_factory_validation(factory, kwargs, message):
    with pytest.raises(RewardError, match=message):
        factory(**kwargs)


def test_completion_ids_length_mismatch_raises():
    with pytest.raises(ValueError, match="completion_ids has 1 rows for 2 completions"):
        length_penalty(4)(["", ""], ["a", "b"], completion_ids=[[1]])

"""load_reward (built-ins, factories, file.py:function), load_reward_specs and the up-front signature check."""

import functools
import textwrap

import pytest

from posttrain.rewards import RewardError, check_reward_signature, load_reward, load_reward_specs, numeric_match


def test_builtin_names():
    assert load_reward("numeric_match") is numeric_match
    fn = load_reward("gsm8k")
    assert fn([""], ["#### 7"], answer=["#### 7"]) == [1.0]
    assert load_reward("boxed")([""], [r"\boxed{2}"], answer=["2"]) == [1.0]


def test_factory_specs():
    fmt = load_reward(r"format:<answer>\d+</answer>")
    assert fmt(["", ""], ["<answer>85</answer>", "85"]) == [1.0, 0.0]
    assert load_reward("format:a:b")([""], ["a:b"]) == [1.0]  # everything after the first ':' is the regex
    assert load_reward("format:85", mode="search")([""], ["is 85!"]) == [1.0]  # options reach the factory
    assert load_reward("think_format")([""], ["<think>x</think><answer>1</answer>"]) == [1.0]
    overlong = load_reward("overlong_penalty:max_len=10,cache_len=5")
    assert overlong([""], ["x"], completion_ids=[[0] * 8]) == [pytest.approx(-0.6)]
    length = load_reward("length_penalty", max_len=4, penalty_factor=0.5)
    assert length([""], ["x"], completion_ids=[[0] * 2]) == [pytest.approx(-0.25)]


@pytest.mark.parametrize(
    "spec, options, message",
    [
        ("exact_match", {}, r"unknown reward 'exact_match': use a built-in \(numeric_match, gsm8k, boxed, format"),
        ("", {}, "non-empty string"),
        ("numeric_match:x", {}, "'numeric_match' takes nothing after ':'"),
        ("numeric_match", {"strict": True}, "takes no options, got strict"),
        ("format", {}, r"'format' needs an argument \(usage: format:<regex>\)"),
        ("format:(", {}, "invalid regular expression"),
        ("overlong_penalty:max_len=10", {}, r"reward 'overlong_penalty'.*cache_len.*usage: overlong_penalty:max_len="),
        ("overlong_penalty:max_len=10,cache_len=2,bogus=1", {}, "unexpected keyword argument 'bogus'"),
        ("length_penalty:max_len", {}, "option 'max_len' is not key=value"),
        ("reward_model:/no/such/dir", {}, "reward model directory not found"),
    ],
)
def test_builtin_spec_errors(spec, options, message):
    with pytest.raises(RewardError, match=message):
        load_reward(spec, **options)


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_load_from_file(tmp_path):
    path = write(
        tmp_path,
        "my_rewards.py",
        """
        from dataclasses import dataclass

        @dataclass
        class Config:  # dataclasses need the module registered in sys.modules while it imports
            bonus: float = 0.5

        def shouty(prompts, completions, **kwargs):
            return [Config().bonus if c.isupper() else 0.0 for c in completions]

        async def later(prompts, completions, **kwargs):
            return [1.0] * len(completions)

        THRESHOLD = 3
    """,
    )
    fn = load_reward(f"{path}:shouty")
    assert fn(["", ""], ["HI", "hi"]) == [0.5, 0.0]
    assert load_reward(f"{path}:shouty") is fn  # the file is imported once
    assert callable(load_reward(f"{path}:later"))


def test_load_from_file_errors(tmp_path):
    path = write(
        tmp_path,
        "rw.py",
        """
        def good(prompts, completions, **kwargs):
            return [0.0] * len(completions)

        def no_kwargs(prompts, completions):
            return []

        THRESHOLD = 3
    """,
    )
    with pytest.raises(RewardError, match=r"reward file .*missing\.py not found"):
        load_reward(f"{tmp_path}/missing.py:good")
    with pytest.raises(RewardError, match=r"rw\.py: no function 'nope' \(it defines: good, no_kwargs\)"):
        load_reward(f"{path}:nope")
    with pytest.raises(RewardError, match=r"rw\.py: 'THRESHOLD' is a int, not a callable"):
        load_reward(f"{path}:THRESHOLD")
    with pytest.raises(RewardError, match=r"no \*\*kwargs and no parameter for 'answer'"):
        check_reward_signature(load_reward(f"{path}:no_kwargs"), "no_kwargs", columns=["answer"])
    broken = write(tmp_path, "broken.py", "import no_such_module_here\n")
    with pytest.raises(RewardError, match=r"broken\.py: import failed: ModuleNotFoundError"):
        load_reward(f"{broken}:f")
    with pytest.raises(RewardError, match="options .* apply to built-ins only"):
        load_reward(f"{path}:good", scale=2)


def test_load_time_signature_check(tmp_path):
    path = write(
        tmp_path,
        "sigs.py",
        """
        def one_arg(completions):
            return [0.0] * len(completions)

        def positional_only(prompts, completions, /, **kwargs):
            return [0.0] * len(completions)
    """,
    )
    with pytest.raises(
        RewardError,
        match=r"reward '.*:one_arg' \(.*one_arg .*sigs\.py:2\)\) cannot be called as "
        r"fn\(prompts, completions, \*\*columns\): it has no \*\*kwargs and no "
        r"parameter for 'prompts'",
    ):
        load_reward(f"{path}:one_arg")
    with pytest.raises(RewardError, match="parameter 'prompts' is positional-only"):
        load_reward(f"{path}:positional_only")


def test_load_reward_specs_weights_and_the_columns_each_function_receives(tmp_path):
    path = write(
        tmp_path,
        "by_ids.py",
        """
        def by_ids(prompts, completions, completion_ids, answer):
            return [float(len(ids)) for ids in completion_ids]
    """,
    )
    # The exact signature names every keyword: the data's columns plus completion_ids, which is added.
    specs = load_reward_specs(["numeric_match", f"{path}:by_ids"], ["answer"], [0.5, 2.0])
    assert [(s.name, s.fn, s.weight) for s in specs] == [
        ("numeric_match", numeric_match, 0.5),
        (f"{path}:by_ids", specs[1].fn, 2.0),
    ]
    assert specs[1].fn(prompts=["p"], completions=["c"], completion_ids=[[1, 2]], answer=["a"]) == [2.0]
    assert [s.weight for s in load_reward_specs(["numeric_match", "gsm8k"], ["answer"])] == [1.0, 1.0]
    with pytest.raises(RewardError, match=r"no \*\*kwargs and no parameter for 'label'"):
        load_reward_specs([f"{path}:by_ids"], ["answer", "label"])  # fails before any generation
    with pytest.raises(RewardError, match="1 reward weights for 2 reward functions"):
        load_reward_specs(["numeric_match", "gsm8k"], ["answer"], [1.0])
    with pytest.raises(RewardError, match="no reward function to load"):
        load_reward_specs([], ["answer"])


def test_signature_rule():
    def trl(completions, solution, **kwargs): ...
    def exact(prompts, completions, answer): ...
    def defaults(prompts, completions, answer=None, *args, scale=1.0, **kwargs): ...
    def short(p, c): ...

    check_reward_signature(trl, "trl")  # columns unknown: 'solution' is taken for a column
    check_reward_signature(trl, "trl", columns=["solution", "extra"])
    check_reward_signature(exact, "exact", columns=["answer"])  # names every keyword it receives
    check_reward_signature(defaults, "defaults", columns=[])
    check_reward_signature(functools.partial(exact, answer=None), "partial", columns=[])
    with pytest.raises(
        RewardError,
        match="required parameter 'solution' is not one of the arguments it gets "
        r"\(prompts, completions, answer\)",
    ):
        check_reward_signature(trl, "trl", columns=["answer"])
    with pytest.raises(RewardError, match=r"no \*\*kwargs and no parameter for 'extra'"):
        check_reward_signature(exact, "exact", columns=["answer", "extra"])
    with pytest.raises(RewardError, match=r"no \*\*kwargs and no parameter for 'prompts', 'completions'"):
        check_reward_signature(short, "short")
    with pytest.raises(RewardError, match="int object is not callable"):
        check_reward_signature(3, "three")


def test_callable_object_with_reward_signature():
    class Scorer:
        def __call__(self, prompts, completions, **kwargs):
            return [1.0] * len(completions)

    check_reward_signature(Scorer(), "scorer", columns=["answer"])

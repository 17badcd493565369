"""Task accuracy and pass@k: hand counts on canned completions, the RL trainer's own greedy evaluation as an
oracle on a real (tiny) engine, and the input errors."""

from __future__ import annotations

import json
import math

import pytest

from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError
from posttrain.eval import Sampling, evaluate_accuracy, file_rows, task_rows
from posttrain.eval.pass_at_k import pass_at_k
from posttrain.rewards import RewardError, RewardSpec
from posttrain.rollout.evaluate import evaluate as trainer_evaluate
from posttrain.tasks import TaskError
from tests.eval.fakes import FakeLLM, chat

# Four problems, four samples each; numeric_match reads the last number.
ROWS = [
    {"prompt": chat("2+2?"), "answer": "4"},
    {"prompt": chat("3+3?"), "answer": "6"},
    {"prompt": chat("5+5?"), "answer": "10"},
    {"prompt": chat("no reference"), "answer": None},
]
COMPLETIONS = {
    "2+2?": ["4", "It is 4.", "5", "4"],  # 3 of 4 correct
    "3+3?": ["7", "8", "six", "6"],  # 1 of 4 (the last)
    "5+5?": ["11", "9", "no idea", "12"],  # 0 of 4
    "no reference": ["1", "2", "3", "4"],  # unscorable: no reference answer
}


def test_greedy_accuracy_equals_a_hand_count():
    llm = FakeLLM(COMPLETIONS)
    result = evaluate_accuracy(llm, ROWS, ["numeric_match"])
    # sample 0 of each problem: "4" right, "7" wrong, "11" wrong, unscorable
    assert (result.correct, result.scorable, result.unscorable, result.samples) == (1, 3, 1, 4)
    assert result.accuracy == pytest.approx(1 / 3)
    assert result.pass_at_k == {1: pytest.approx(1 / 3)} and result.problems_for_k == {1: 3}
    n, params, progress = llm.calls[0]
    assert (n, params.n, params.temperature, params.seed) == (4, 1, 0.0, 0) and progress is False
    assert [r["correct"] for r in result.records] == [True, False, False, False]
    assert result.records[3]["reward"] is None


def test_sampled_pass_at_k_equals_a_hand_count():
    result = evaluate_accuracy(
        FakeLLM(COMPLETIONS), ROWS, ["numeric_match"], sampling=Sampling(n=4, temperature=1.0), ks=[1, 2, 4]
    )
    assert (result.correct, result.scorable, result.unscorable) == (4, 12, 4)
    assert result.accuracy == pytest.approx(4 / 12)
    # per problem (n, c): (4, 3), (4, 1), (4, 0); pass@2 = mean(1 - C(1,2)/C(4,2), 1 - C(3,2)/C(4,2), 0)
    assert result.pass_at_k[1] == pytest.approx((3 / 4 + 1 / 4 + 0) / 3)
    assert result.pass_at_k[2] == pytest.approx((1 + (1 - 3 / 6) + 0) / 3)
    assert result.pass_at_k[4] == pytest.approx((1 + 1 + 0) / 3)
    assert result.problems_for_k == {1: 3, 2: 3, 4: 3}
    assert result.to_dict()["pass_at_k"] == {
        "pass@1": result.pass_at_k[1],
        "pass@2": result.pass_at_k[2],
        "pass@4": result.pass_at_k[4],
    }


def test_custom_reward_from_a_file_threshold_and_partly_unscorable_problems(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def graded(prompts, completions, answer, **kwargs):\n"
        "    out = []\n"
        "    for text in (c[0]['content'] if isinstance(c, list) else c for c in completions):\n"
        "        out.append(None if text == 'no idea' else float(len(text)) / 10)\n"
        "    return out\n"
    )
    spec = f"{reward_file}:graded"
    result = evaluate_accuracy(
        FakeLLM(COMPLETIONS), ROWS, [spec], sampling=Sampling(n=4, temperature=1.0), ks=[1, 4], threshold=0.2
    )
    assert result.unscorable == 1 and result.scorable == 15
    # reward >= 0.2 means at least 2 characters: "It is 4." | "six" | "11", "12" | none of "1".."4"
    counts = [(4, 1), (4, 1), (3, 2), (4, 0)]  # (scorable, correct) per problem; "no idea" is unscorable
    assert result.correct == 4 and result.accuracy == pytest.approx(4 / 15)
    assert result.problems_for_k == {1: 4, 4: 3}  # problem 3 has 3 scorable samples: not in pass@4
    assert result.pass_at_k[1] == pytest.approx(sum(pass_at_k(n, c, 1) for n, c in counts) / 4)
    assert result.pass_at_k[4] == pytest.approx(sum(pass_at_k(n, c, 4) for n, c in counts if n >= 4) / 3)


def test_threshold_compares_at_the_rewards_float32_precision():
    def seven_tenths(prompts, completions, **kwargs):
        return [0.7] * len(completions)  # 0.7 in float32 is 0.699999988...: still >= a threshold of 0.7

    result = evaluate_accuracy(FakeLLM(COMPLETIONS), ROWS[:3], [RewardSpec("r", seven_tenths, 1.0)], threshold=0.7)
    assert (result.correct, result.accuracy) == (3, 1.0)


def test_matches_the_rl_trainers_greedy_evaluation_on_a_real_engine():
    from posttrain.engine import LLM
    from tests.data.tiny import tiny_model, tiny_tokenizer

    llm = LLM(model=tiny_model(seed=1), tokenizer=tiny_tokenizer(), max_model_len=96, num_kv_blocks=64)

    def even_length(prompts, completions, **kwargs):
        return [float(len(c) % 2 == 0) for c in completions]

    rows = task_rows("arithmetic", 12).rows
    specs = [RewardSpec("even_length", even_length, 1.0)]
    ours = evaluate_accuracy(llm, rows, specs, sampling=Sampling(max_tokens=8))
    theirs, samples = trainer_evaluate(llm, rows, specs, max_tokens=8, threshold=1.0)
    assert ours.accuracy == theirs["eval/accuracy"]
    assert [r["completion"] for r in ours.records] == [s["completion"] for s in samples]
    assert ours.correct == sum(len(s["completion"]) % 2 == 0 for s in samples)


def test_task_rows_are_the_trainers_held_out_problems():
    from posttrain.tasks import make_task

    assert task_rows("arithmetic", 5).rows == make_task("arithmetic").held_out(5)
    assert task_rows("arithmetic", 5).default_reward == "numeric_match"
    with pytest.raises(TaskError, match="unknown task 'algebra'"):
        task_rows("algebra", 5)


def test_file_rows_and_their_errors(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "solution": 4}) + "\n" + json.dumps({"question": "3+3?"}) + "\n")
    with pytest.raises(DataError, match=r"qa.jsonl:2: no answer column 'solution' \(columns: question\)"):
        file_rows(data, "question", "solution")
    with pytest.raises(DataError, match=r"qa.jsonl:1: no prompt column 'prompt'"):
        file_rows(data, "prompt", "solution")
    rows = file_rows(data, "question", "solution", max_rows=1, system_prompt="Be brief.").rows
    assert rows == [
        {"answer": 4, "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}
    ]
    rows = file_rows(data, "question", "solution", max_rows=1, template="Q: {question}").rows
    assert rows[0]["prompt"] == [{"role": "user", "content": "Q: 2+2?"}]
    with pytest.raises(PosttrainError, match=r"qa.jsonl:1: prompt template 'Q: \{missing\}' cannot be filled"):
        file_rows(data, "question", "solution", template="Q: {missing}")


def test_bad_arguments_fail_before_generation(tmp_path):
    llm = FakeLLM(COMPLETIONS)
    needs_solution = tmp_path / "needs_solution.py"
    needs_solution.write_text("def f(prompts, completions, solution, **kwargs):\n    return [1.0] * len(completions)\n")
    with pytest.raises(PosttrainError, match=r"k=5 is more than the n=4 samples"):
        evaluate_accuracy(llm, ROWS, ["numeric_match"], sampling=Sampling(n=4, temperature=1.0), ks=[1, 5])
    with pytest.raises(PosttrainError, match="identical greedy samples"):
        evaluate_accuracy(llm, ROWS, ["numeric_match"], sampling=Sampling(n=4))
    with pytest.raises(RewardError, match="unknown reward 'exact'"):
        evaluate_accuracy(llm, ROWS, ["exact"])
    with pytest.raises(RewardError, match=r"reward file .*missing.py not found"):
        evaluate_accuracy(llm, ROWS, ["missing.py:fn"])
    with pytest.raises(RewardError, match=r"required parameter 'solution' is not one of the arguments"):
        evaluate_accuracy(llm, ROWS, [f"{needs_solution}:f"])
    assert llm.calls == []
    with pytest.raises(PosttrainError, match="threshold must be a finite number"):
        evaluate_accuracy(llm, ROWS, ["numeric_match"], threshold=math.nan)


def test_a_reward_that_raises_makes_samples_unscorable_not_wrong():
    def broken(prompts, completions, **kwargs):
        raise RuntimeError("grader offline")

    result = evaluate_accuracy(FakeLLM(COMPLETIONS), ROWS, [RewardSpec("broken", broken, 1.0)])
    assert (result.accuracy, result.scorable, result.unscorable, result.pass_at_k) == (None, 0, 4, {})
    assert result.reward_errors == ["broken: RuntimeError: grader offline"]


def test_make_engine_sizes_the_context_to_the_longest_prompt(tmp_path):
    from posttrain.eval.generation import make_engine
    from tests.data.tiny import save_tiny_model_dir, tiny_tokenizer

    directory = save_tiny_model_dir(tmp_path / "model")
    rows = [{"prompt": chat("a short one")}, {"prompt": "a plain text prompt that is somewhat longer"}]
    llm = make_engine(directory, rows, Sampling(n=2, temperature=1.0, max_tokens=5))
    tokenizer = tiny_tokenizer()
    longest = max(
        len(tokenizer.apply_chat_template(chat("a short one"), add_generation_prompt=True, tokenize=True)),
        len(tokenizer.encode(rows[1]["prompt"], add_special_tokens=True)),
    )
    assert llm.engine.config.max_model_len == longest + 5
    assert llm.engine.config.max_num_seqs == 4  # 2 prompts x 2 samples, one wave
    result = evaluate_accuracy(
        llm,
        [dict(r, answer="1") for r in rows],
        ["numeric_match"],
        sampling=Sampling(n=2, temperature=1.0, max_tokens=5),
    )
    assert result.samples == 4 and result.scorable == 4

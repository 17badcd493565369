"""`posttrain eval accuracy | em-f1 | preference` end to end on small inputs: JSON output whose numbers
agree with the samples written, the Python API and a recount; and the one-line errors (exit status 2)."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.eval.em_f1 import exact_match, token_f1
from posttrain.rewards import numeric_match, save_score_head
from tests.data.tiny import save_tiny_model_dir
from tests.trainers.pref_helpers import pair_rows, write_jsonl


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", seed=4)


def test_accuracy_on_the_default_model(capsys, tmp_path):
    samples = tmp_path / "samples.jsonl"
    out = run_json(
        capsys,
        [
            "eval",
            "accuracy",
            "--task",
            "arithmetic",
            "--num",
            "3",
            "--max-tokens",
            "12",
            "--json",
            "--samples",
            str(samples),
        ],
    )
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert (out["problems"], out["samples"], out["scorable"], out["unscorable"], len(records)) == (3, 3, 3, 0, 3)
    recount = numeric_match(
        [r["prompt"] for r in records], [r["completion"] for r in records], answer=[r["answer"] for r in records]
    )
    assert out["correct"] == sum(recount) == sum(r["correct"] for r in records)
    assert out["accuracy"] == out["pass_at_k"]["pass@1"] == pytest.approx(out["correct"] / 3)
    assert (out["reward"], out["temperature"], out["max_tokens"]) == (["numeric_match"], 0.0, 12)


def test_sampled_accuracy_from_a_file_with_a_custom_reward(capsys, tmp_path, tiny_dir):
    data = write_jsonl(
        tmp_path / "qa.jsonl", [{"question": f"What is {a} plus {a}?", "solution": str(2 * a)} for a in range(1, 5)]
    )
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def has_space(prompts, completions, answer, **kwargs):\n    return [float(' ' in c) for c in completions]\n"
    )
    argv = [
        "eval",
        "accuracy",
        "--model",
        str(tiny_dir),
        "--data",
        str(data),
        "--prompt-column",
        "question",
        "--answer-column",
        "solution",
        "--reward",
        f"{reward}:has_space",
        "--n",
        "3",
        "--temperature",
        "1.0",
        "--seed",
        "7",
        "--k",
        "1,3",
        "--max-tokens",
        "6",
        "--json",
        "--samples",
        str(tmp_path / "s.jsonl"),
    ]
    out = run_json(capsys, argv)
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert (out["problems"], out["samples_per_problem"], out["samples"], len(records)) == (4, 3, 12, 12)
    per_problem = [sum(" " in r["completion"] for r in records if r["problem"] == p) for p in range(4)]
    assert out["correct"] == sum(per_problem)
    assert out["pass_at_k"]["pass@3"] == pytest.approx(sum(c > 0 for c in per_problem) / 4)
    assert out["pass_at_k"]["pass@1"] == pytest.approx(sum(per_problem) / 12)
    assert run_json(capsys, argv) == out  # seeded: the same samples again


def test_em_f1_cli(capsys, tmp_path, tiny_dir):
    data = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"prompt": "Name a colour.", "answer": ["blue", "red"]},
            {"prompt": "Say hello.", "answer": "hello"},
            {"prompt": "No reference here.", "answer": None},
        ],
    )
    samples = tmp_path / "s.jsonl"
    out = run_json(
        capsys,
        [
            "eval",
            "em-f1",
            "--model",
            str(tiny_dir),
            "--data",
            str(data),
            "--max-tokens",
            "5",
            "--json",
            "--samples",
            str(samples),
        ],
    )
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert (out["samples"], out["scorable"], out["unscorable"], out["no_match"]) == (3, 2, 1, 0)
    assert out["f1"] == pytest.approx(
        sum(max(token_f1(r["completion"], ref) for ref in r["references"]) for r in records[:2]) / 2
    )
    assert out["exact_match"] == pytest.approx(
        sum(max(exact_match(r["completion"], ref) for ref in r["references"]) for r in records[:2]) / 2
    )


def test_preference_cli_reward_model_and_dpo(capsys, tmp_path, tiny_dir):
    from posttrain.eval import evaluate_reward_model

    rm = save_tiny_model_dir(tmp_path / "rm", seed=5)
    torch.manual_seed(1)
    save_score_head(torch.nn.Linear(32, 1), rm)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    out = run_json(capsys, ["eval", "preference", "--data", str(data), "--reward-model", str(rm), "--json"])
    api = evaluate_reward_model(rm, data)
    assert (out["pairs"], out["accuracy"], out["wins"], out["ties"]) == (8, api.accuracy, api.wins, api.ties)
    assert (out["data"], out["data_report"]["format"], out["reward_model"]) == (str(data), "preference", str(rm))
    assert out["mean_margin"] == pytest.approx(api.mean_margin)
    same = run_json(
        capsys,
        [
            "eval",
            "preference",
            "--data",
            str(data),
            "--model",
            str(tiny_dir),
            "--ref-model",
            str(tiny_dir),
            "--beta",
            "0.2",
            "--json",
        ],
    )
    assert (same["pairs"], same["ties"], same["accuracy"], same["mean_margin"]) == (8, 8, 0.5, 0.0)
    assert same["scorer"] == "dpo" and same["beta"] == 0.2


def test_errors_are_one_line_with_exit_status_2(capsys, tmp_path, tiny_dir):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?"}])
    base = ["eval", "accuracy", "--model", str(tiny_dir), "--data", str(data)]
    assert "no reward function" in run_error(capsys, base)
    assert "unknown reward 'exact'" in run_error(capsys, base + ["--reward", "exact"])
    assert "missing.py not found" in run_error(capsys, base + ["--reward", "missing.py:score"])
    assert "bad.jsonl:2: no answer column 'answer'" in run_error(
        capsys, ["eval", "accuracy", "--data", str(bad), "--reward", "numeric_match"]
    )
    assert "k=5 is more than the n=2 samples" in run_error(
        capsys, base + ["--reward", "numeric_match", "--n", "2", "--temperature", "1", "--k", "1,5"]
    )
    assert "give --task or --data, not both" in run_error(capsys, base + ["--task", "arithmetic"])
    with pytest.raises(SystemExit):  # argparse: unknown task / unknown eval task
        main(["eval", "accuracy", "--task", "algebra"])
    assert "invalid choice: 'algebra'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "bleu"])
    assert "invalid choice: 'bleu'" in capsys.readouterr().err
    assert "--ref-model REF" in run_error(capsys, ["eval", "preference", "--data", str(data), "--model", "x"])
    assert "give --reward-model DIR, or --model" in run_error(capsys, ["eval", "preference", "--data", str(data)])


def test_a_file_of_questions_needs_no_prompt_column(capsys, tmp_path, tiny_dir):
    """examples/data/calculator/test.jsonl's format ({"question", "answer"}) without --prompt-column: the
    model without tools, as the agentic demo's baseline is measured."""
    rows = [{"question": f"What is {a} times 12?", "answer": str(12 * a)} for a in range(101, 104)]
    data = write_jsonl(tmp_path / "calc.jsonl", rows)
    samples = tmp_path / "s.jsonl"
    argv = ["eval", "accuracy", "--model", str(tiny_dir), "--data", str(data), "--reward", "numeric_match"]
    out = run_json(capsys, argv + ["--max-tokens", "4", "--json", "--samples", str(samples)])
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert out["problems"] == len(records) == 3
    assert [r["prompt"][-1]["content"] for r in records] == [row["question"] for row in rows]
    assert [r["answer"] for r in records] == [row["answer"] for row in rows]

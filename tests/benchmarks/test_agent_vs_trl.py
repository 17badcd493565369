"""benchmarks/agent_vs_trl.py without training: its options, its dry run (the settings both sides take from
examples/agent_calculator.yaml), the reward it gives TRL, the rows TRL trains on, the snapshot clock and the
curves it writes."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("agent_vs_trl", ROOT / "benchmarks" / "agent_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["agent_vs_trl"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("agent_vs_trl", None)


def test_options_and_their_bounds(bench, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args([])
    assert (args.minutes, args.eval_size, args.points, args.only) == (30.0, 200, 6, None)
    assert args.precision == "fp32"  # both sides in fp32 unless asked otherwise
    args = bench.parse_args(["--minutes", "2", "--eval-size", "20", "--points", "1", "--only", "trl"])
    assert (args.minutes, args.eval_size, args.points, args.only) == (2.0, 20, 1, "trl")
    for bad, named in (
        (["--minutes", "0"], "--minutes"),
        (["--eval-size", "201"], "--eval-size"),
        (["--points", "0"], "--points"),
        (["--precision", "fp16"], "--precision"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert named in capsys.readouterr().err


def test_dry_run_takes_the_example_config(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(
        ["--dry-run", "--minutes", "12", "--points", "4", "--eval-size", "20", "--start", str(tmp_path / "none")]
    )
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    settings = plan["settings"]
    assert (settings["prompts_per_step"], settings["samples_per_prompt"], settings["max_turns"]) == (4, 4, 3)
    assert (settings["max_tokens"], settings["max_episode_tokens"]) == (40, 160)
    assert plan["sides"] == ["posttrain", "trl"] and plan["snapshot_every_min"] == 3.0
    assert plan["cold_start"][-2:] == [
        "sft",
        str(bench.DEMOS["calculator"].sft_config),
    ]  # no start checkpoint: the SFT config runs first
    assert plan["eval"][plan["eval"].index("--num") + 1] == "20"
    assert (plan["precision"], plan["posttrain_model_dtype"]) == ("fp32", "float32")


def test_dry_run_bf16_trains_posttrain_under_autocast(bench, tmp_path: Path, capsys) -> None:
    bench.main(["--dry-run", "--precision", "bf16", "--start", str(tmp_path / "none")])
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (plan["precision"], plan["posttrain_model_dtype"]) == ("bf16", "auto")  # as TRL's bf16=True


def test_trl_reward_is_the_environments(bench) -> None:
    answer = "10063"
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator"}}],
    }
    completions = [
        [call, {"role": "tool", "content": answer}, {"role": "assistant", "content": "The answer is 10063."}],
        [call, {"role": "tool", "content": answer}, {"role": "assistant", "content": "The answer is 10064."}],
        [call, {"role": "tool", "content": answer}],  # cut off after the tool: no final answer
        [{**call, "content": "10063"}],  # the right number, but in a turn that calls a tool
    ]
    assert bench.final_answer_reward(completions, [answer] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_trl_rows_open_as_the_environment_does(bench) -> None:
    from posttrain.envs.calculator import SYSTEM_PROMPT

    rows = bench.trl_rows(bench.DEMOS["calculator"], {"data_seed": 0, "task_options": {}}, 3)
    assert len(rows) == 3
    for row in rows:
        assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert row["prompt"][1]["role"] == "user" and int(row["answer"]) >= 1000


def test_word_problems_demo_takes_its_own_config_tool_and_rows(bench, tmp_path: Path, capsys) -> None:
    from posttrain.envs import builtin_tools
    from posttrain.envs.word_problems import SYSTEM_PROMPT

    args = bench.parse_args(["--task", "word_problems"])
    assert args.start == ROOT / "runs" / "word-problems-sft" / "final"
    assert getattr(builtin_tools, args.demo.tool) is builtin_tools.calculate
    bench.main(["--dry-run", "--task", "word_problems", "--start", str(tmp_path / "none")])
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (plan["settings"]["samples_per_prompt"], plan["settings"]["max_turns"]) == (4, 6)
    assert str(ROOT / "examples" / "data" / "word_problems" / "test.jsonl") in plan["eval"]
    assert plan["settings"]["step_reward"] == 0.1  # the config's process reward reaches TRL's side too
    rows = bench.trl_rows(args.demo, {"data_seed": 0, "task_options": {"operation_weights": [0, 0, 1]}}, 4)
    assert all(r["prompt"][0]["content"] == SYSTEM_PROMPT and r["answer"] and r["chain"] for r in rows)
    assert {r["operations"] for r in rows} == {4}  # the config's mix of chain lengths reaches TRL's draws
    first, second = bench.reward_functions(0.1)
    assert first is bench.final_answer_reward
    tool = {"role": "tool", "content": ""}
    completions = [[{**tool, "content": "120"}, {**tool, "content": "30"}], [{**tool, "content": "30"}]]
    start, chain = [100, 100], [[["+", 20], ["/", 4]]] * 2
    assert second(completions, start=start, chain=chain, answer=["30", "30"]) == [0.2, 0.0]  # in order only
    assert bench.reward_functions(0.0) == [bench.final_answer_reward]


def test_guess_number_tools_demo_plays_the_games_class_on_both_sides(bench, tmp_path: Path, capsys) -> None:
    from posttrain.envs import guess_number_tools

    args = bench.parse_args(["--task", "guess_number_tools"])
    assert args.demo.tool is None and args.demo.environment_factory.endswith(":GuessNumberGame")
    bench.main(["--dry-run", "--task", "guess_number_tools", "--start", str(tmp_path / "none")])
    settings = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]
    assert settings["env_options"] == {"max_turns": 7, "show_range": True}  # TRL builds the game as the config does
    assert (settings["max_turns"], settings["step_reward"]) == (8, 0.0)
    rows = bench.trl_rows(args.demo, settings, 3)
    assert all(r["prompt"][0]["content"] == guess_number_tools.SYSTEM_PROMPT for r in rows)
    assert all(1 <= r["secret"] <= 100 for r in rows)  # the columns TRL's reset(**row) receives


def test_snapshots_are_evenly_spaced(bench, tmp_path: Path) -> None:
    clock = bench.Snapshots(tmp_path, minutes=10, points=5)  # every 2 minutes
    assert not clock.due(119)
    assert clock.due(120)
    clock.record(tmp_path / "snapshot-1", 125, step=3)
    assert not clock.due(200) and clock.due(240)
    assert clock.saved == [{"path": str(tmp_path / "snapshot-1"), "minutes": round(125 / 60, 3), "step": 3}]


def test_curves_and_summary(bench, tmp_path: Path) -> None:
    start = {"minutes": 0.0, "step": 0, "accuracy": 0.1, "tool_calls_per_episode": 0.2}
    curves = {
        "posttrain": [start, {"minutes": 2.0, "step": 5, "accuracy": 0.9, "tool_calls_per_episode": 1.0}],
        "trl": [start, {"minutes": 2.0, "step": 3, "accuracy": 0.6, "tool_calls_per_episode": 0.8}],
    }
    bench.write_curves(tmp_path, curves)
    assert json.loads((tmp_path / "curves.json").read_text()) == curves
    with open(tmp_path / "curves.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["side"], r["step"], r["accuracy"]) for r in rows] == [
        ("posttrain", "0", "0.1"), ("posttrain", "5", "0.9"), ("trl", "0", "0.1"), ("trl", "3", "0.6"),
    ]  # fmt: skip
    result = bench.summary(curves, tmp_path, bench.parse_args(["--minutes", "2", "--eval-size", "20"]))
    assert result["posttrain"]["accuracy"] == 0.9 and result["trl"]["step"] == 3
    assert result["accuracy_ratio"] == 1.5
    assert result["precision"] == "fp32" and set(result["sides"]) == {"posttrain", "trl"}
    assert all(
        entry["compute"] == "float32" and not entry["gradient_checkpointing"] for entry in result["sides"].values()
    )
    assert "trl" in result["sides"]["trl"]["versions"] and "posttrain" in result["sides"]["posttrain"]["versions"]

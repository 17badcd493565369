"""benchmarks/async_rl.py: which runs each case makes, the order they alternate in, and the figures its JSON line
derives (medians over rounds, async/sync speedups with their spread, the rate kept under tool latency)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import async_rl  # noqa: E402


def _args(*argv: str):
    return async_rl.build_parser().parse_args(list(argv))


def test_tool_latency_runs_the_word_problems_agent_with_and_without_the_wait(tmp_path: Path) -> None:
    found = async_rl.settings(["tool_latency"], _args("--tool-latency", "0.5", "2", "--set", "a.b=1"), tmp_path)
    assert list(found) == ["tool_latency_0", "tool_latency_0.5", "tool_latency_2"]
    config, overrides = found["tool_latency_2"]
    assert config == async_rl.TOOL_CONFIG and config.exists()
    assert overrides == [
        "model.dtype=float32",
        "model.name_or_path=runs/word-problems-sft/final",
        "env.tool_latency_s=2.0",
        "env.workers=48",  # every episode in flight may wait at once
        "a.b=1",
    ]


def test_slow_reward_writes_its_reward_and_bf16_is_autocast(tmp_path: Path) -> None:
    found = async_rl.settings(["plain", "slow_reward"], _args("--latency", "0.25", "--precision", "bf16"), tmp_path)
    assert found["plain"] == (None, ["model.dtype=auto"])
    assert "time.sleep(0.25)" in (tmp_path / "slow_reward.py").read_text()
    assert found["slow_reward"][1][1] == f"reward.functions=[{tmp_path / 'slow_reward.py'}:slow_numeric_match]"


def _run(rate: float, accuracy: float | None = 0.5) -> dict:
    return {"steps": 10, "steps_per_hour": rate, "accuracy": accuracy}


def test_summary_takes_medians_and_per_round_ratios() -> None:
    results = {
        "tool_latency_0/sync": [_run(100.0), _run(120.0)],
        "tool_latency_0/async": [_run(110.0), _run(130.0)],
        "tool_latency_2/sync": [_run(50.0), _run(70.0, None)],
        "tool_latency_2/async": [_run(100.0, 0.6), _run(116.0, 0.4) | {"staleness_mean": 0.5}],
    }
    summary = async_rl.summarize(results)
    assert summary["runs"]["tool_latency_0/sync"]["steps_per_hour"] == 110.0
    assert summary["runs"]["tool_latency_2/sync"]["accuracy"] == 0.5  # a run without an accuracy is left out
    assert summary["runs"]["tool_latency_2/async"]["staleness_mean"] == 0.5
    # async / sync round by round: 2.0 and 116/70
    speedup = summary["speedup"]["tool_latency_2/async"]
    assert speedup["ratio_min"] == round(116 / 70, 3) and speedup["ratio_max"] == 2.0
    assert set(summary["speedup"]) == {"tool_latency_0/async", "tool_latency_2/async"}
    # steps/h with the wait over steps/h without it, per mode: async kept 108/120, sync 60/110
    assert summary["retained"] == {"tool_latency_2/sync": round(60 / 110, 3), "tool_latency_2/async": 0.9}


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--cases", "plain,fast"], "--cases: unknown fast"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--modes", "sync,async_k3"], "--modes: unknown async_k3"),
        (["--cases", "tool_latency", "--tool-latency", "0"], "each value must be > 0"),
        (["--cases", "tool_latency", "--tool-start", "no/such/model"], "--tool-start no/such/model: not found"),
    ],
)
def test_bad_arguments_are_one_line(argv: list[str], error: str, capsys) -> None:
    with pytest.raises(SystemExit):
        async_rl.main(argv)
    assert error in capsys.readouterr().err


def test_modes_choose_the_runs_and_sync_always_runs_first(tmp_path: Path, monkeypatch, capsys) -> None:
    calls = []

    def fake_run(out, config, mode, staleness, minutes, extra):
        calls.append((out.name, mode, staleness, extra[-1]))
        return _run(100.0 + staleness)

    monkeypatch.setattr(async_rl, "run_one", fake_run)
    async_rl.main(["--cases", "plain", "--modes", "async_k2_fill", "--rounds", "1", "--out", str(tmp_path)])
    assert calls == [
        ("plain-sync-1", "sync", 0, "model.dtype=float32"),
        ("plain-async_k2_fill-1", "async", 2, "rollout.async_fill=0.5"),
    ]
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["runs"]) == {"plain/sync", "plain/async_k2_fill"}
    assert report["speedup"]["plain/async_k2_fill"]["ratio_min"] == 1.02

"""posttrain.run_dir: where a run writes, and when an existing directory may be reused."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.errors import PosttrainError
from posttrain.run_dir import final_dir, make_run_dir


@dataclass
class OptimConfig:
    lr: float = 1e-4


@dataclass
class RunConfig:
    steps: int = 10
    out_path: Path = Path("out/model")
    optim: OptimConfig = field(default_factory=OptimConfig)


def test_default_run_dir_is_timestamped_and_holds_config(tmp_path):
    run = make_run_dir("sft", None, RunConfig(steps=3), runs_root=tmp_path / "runs")
    assert run.parent == tmp_path / "runs"
    assert re.fullmatch(r"sft-\d{8}-\d{6}", run.name)
    assert load_config(RunConfig, run / "config.yaml") == RunConfig(steps=3)


def test_runs_started_in_the_same_second_get_distinct_dirs(tmp_path):
    runs = {make_run_dir("dpo", None, RunConfig(), runs_root=tmp_path) for _ in range(3)}
    assert len(runs) == 3
    assert all(run.is_dir() and (run / "config.yaml").is_file() for run in runs)


def test_explicit_out_is_created_with_parents(tmp_path):
    out = tmp_path / "a" / "b"
    assert make_run_dir("sft", str(out), RunConfig()) == out
    assert (out / "config.yaml").is_file()


def test_existing_dir_without_a_run_is_reused(tmp_path):
    (tmp_path / "slurm.log").write_text("log")
    make_run_dir("sft", tmp_path, RunConfig())
    assert (tmp_path / "slurm.log").read_text() == "log"
    assert (tmp_path / "config.yaml").is_file()


def test_dir_of_another_run_is_refused_unless_resuming(tmp_path):
    make_run_dir("sft", tmp_path, RunConfig())
    with pytest.raises(PosttrainError, match=rf"{tmp_path}: already holds another run"):
        make_run_dir("sft", tmp_path, RunConfig())
    assert make_run_dir("sft", tmp_path, RunConfig(), resume=True) == tmp_path


def test_resume_with_same_config_keeps_one_config_file(tmp_path):
    make_run_dir("sft", tmp_path, RunConfig(steps=5))
    make_run_dir("sft", tmp_path, RunConfig(steps=5), resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_resume_with_changed_config_keeps_the_previous_one(tmp_path):
    make_run_dir("sft", tmp_path, RunConfig(steps=5))
    make_run_dir("sft", tmp_path, RunConfig(steps=50), resume=True)
    make_run_dir("sft", tmp_path, RunConfig(steps=500), resume=True)
    kept = sorted(tmp_path.glob("config.before-resume-*.yaml"))
    assert len(kept) == 2
    assert {load_config(RunConfig, p).steps for p in kept} == {5, 50}
    assert load_config(RunConfig, tmp_path / "config.yaml").steps == 500


def test_resume_needs_an_earlier_run(tmp_path):
    with pytest.raises(PosttrainError, match=r"nothing to resume"):
        make_run_dir("sft", tmp_path / "missing", RunConfig(), resume=True)
    with pytest.raises(PosttrainError, match=r"nothing to resume"):
        make_run_dir("sft", tmp_path, RunConfig(), resume=True)
    with pytest.raises(PosttrainError, match=r"pass --out"):
        make_run_dir("sft", None, RunConfig(), resume=True, runs_root=tmp_path)


def test_out_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(PosttrainError, match=r"not a directory"):
        make_run_dir("sft", target, RunConfig())


def test_command_must_be_a_plain_name(tmp_path):
    with pytest.raises(ValueError):
        make_run_dir("../sft", None, RunConfig(), runs_root=tmp_path)


def test_final_dir(tmp_path):
    assert final_dir(tmp_path) == tmp_path / "final"
    assert final_dir(str(tmp_path)) == tmp_path / "final"
    assert not (tmp_path / "final").exists()

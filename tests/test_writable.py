"""An output directory that cannot be written is one `error:` line naming it, exit 2, before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main as cli_main
from posttrain.errors import PosttrainError
from posttrain.run_dir import make_run_dir
from posttrain.writable import check_writable_dir

NO_MODEL = "/nonexistent/model"  # reaching the model load would fail naming this path instead of --out
SYSFS = Path("/sys/kernel")  # refuses mkdir even for root, where permission bits would not


def unwritable_outs(tmp_path: Path) -> list[tuple[Path, str]]:
    """(an --out that cannot be created, what the error line must say after the headline)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    outs = [(blocker / "run", f"{blocker} exists and is not a directory")]
    if SYSFS.is_dir():
        outs.append((SYSFS / "posttrain-run", ""))  # the OS's words: EPERM for mkdir, EACCES for a file
    return outs


TRAINERS = {
    "sft": [f"model.name_or_path={NO_MODEL}", "data.path=/nonexistent/train.jsonl"],
    "dpo": [f"model.name_or_path={NO_MODEL}", "data.path=/nonexistent/pairs.jsonl"],
    "rm": [f"model.name_or_path={NO_MODEL}", "data.path=/nonexistent/pairs.jsonl"],
    "distill": [
        f"model.name_or_path={NO_MODEL}",
        f"teacher.name_or_path={NO_MODEL}",
        "data.path=/nonexistent/train.jsonl",
    ],
    "grpo": [f"model.name_or_path={NO_MODEL}"],  # the built-in arithmetic task: no data file
    "ppo": [f"model.name_or_path={NO_MODEL}"],
}
MODEL_WRITERS = {
    "convert": ["--model", NO_MODEL],
    "quantize": ["--model", NO_MODEL, "--scheme", "int8"],
    "lora-merge": ["--model", NO_MODEL, "--adapter", "/nonexistent/adapter"],
}


def assert_one_error_line(capsys, out: Path, reason: str, headline: str = "cannot write the output directory") -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {out}: {headline}: ") and reason in err[0], err[0]
    assert NO_MODEL not in err[0]


@pytest.mark.parametrize("command", sorted(TRAINERS))
def test_trainers_refuse_an_unwritable_out_before_loading(command, tmp_path, capsys):
    for out, reason in unwritable_outs(tmp_path):
        assert cli_main([command, *TRAINERS[command], f"out={out}"]) == 2
        assert_one_error_line(capsys, out, reason)


@pytest.mark.parametrize("command", sorted(MODEL_WRITERS))
def test_model_writers_refuse_an_unwritable_out_before_loading(command, tmp_path, capsys):
    for out, reason in unwritable_outs(tmp_path):
        assert cli_main([command, *MODEL_WRITERS[command], "--out", str(out)]) == 2
        assert_one_error_line(capsys, out, reason)


def test_a_writable_out_is_left_as_it_was(tmp_path, capsys):
    # The check creates the missing directories to find out, then removes them: a run that fails later
    # (here: no model) leaves no empty directory behind.
    out = tmp_path / "new" / "deeper" / "run"
    assert cli_main(["sft", f"model.name_or_path={NO_MODEL}", "data.path=/nonexistent/train.jsonl", f"out={out}"]) == 2
    assert "/nonexistent" in capsys.readouterr().err  # it got past the check
    assert list(tmp_path.iterdir()) == []
    assert cli_main(["convert", "--model", NO_MODEL, "--out", str(out)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_check_writable_dir_probes_without_leaving_anything(tmp_path):
    check_writable_dir(tmp_path / "x" / "y")
    existing = tmp_path / "existing"
    existing.mkdir()
    check_writable_dir(existing)
    assert [p.name for p in tmp_path.iterdir()] == ["existing"] and list(existing.iterdir()) == []


def test_the_error_names_the_output_not_the_probe(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    with pytest.raises(PosttrainError, match=rf"^{blocker}: cannot write the output directory: exists and is not"):
        check_writable_dir(blocker)
    with pytest.raises(PosttrainError, match=rf"^{tmp_path}/out: cannot write the output directory: {blocker} exists"):
        check_writable_dir(blocker / "sub", subject=tmp_path / "out")


def test_make_run_dir_reports_a_file_in_the_way(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    with pytest.raises(PosttrainError, match=rf"^{blocker}/run: cannot write the output directory: {blocker} exists"):
        make_run_dir("sft", blocker / "run", {"steps": 1})
    with pytest.raises(PosttrainError, match=rf"^{blocker}/runs: cannot write the output directory"):
        make_run_dir("sft", None, {"steps": 1}, runs_root=blocker / "runs")


def test_report_refuses_an_unwritable_out(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    for out, reason in unwritable_outs(tmp_path):
        assert cli_main(["report", str(run), "--out", str(out)]) == 2
        assert_one_error_line(capsys, out, reason, "cannot write the report")


def test_eval_refuses_an_unwritable_samples_file_before_loading(tmp_path, capsys):
    # --samples is written after the whole evaluation: its path is checked before the model loads
    cases = [(out.with_suffix(".jsonl"), reason) for out, reason in unwritable_outs(tmp_path)]
    for samples, reason in cases + [(tmp_path, "it is a directory")]:
        assert (
            cli_main(["eval", "accuracy", "--task", "arithmetic", "--model", NO_MODEL, "--samples", str(samples)]) == 2
        )
        assert_one_error_line(capsys, samples, reason, "cannot write the file")


def test_a_refusing_existing_directory_is_named_once(tmp_path):
    # What a read-only mount says to the probe file: the error names the directory, not the probe
    from posttrain.writable import os_error_line

    probe = OSError(30, "Read-only file system", str(tmp_path / ".posttrain-write-check-abc"))
    assert (
        os_error_line(tmp_path, probe, "cannot write the report") == f"{tmp_path}: cannot write the report: "
        "Read-only file system"
    )
    parent = OSError(13, "Permission denied", str(tmp_path))
    assert (
        os_error_line(tmp_path / "run", parent, "cannot create the run directory")
        == f"{tmp_path / 'run'}: cannot create the run directory: {tmp_path}: Permission denied"
    )

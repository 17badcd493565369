"""`posttrain report`: renders from synthetic metrics (RL and SFT shaped), and fails clearly on bad input."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.errors import PosttrainError
from posttrain.metrics import MetricsLogger
from posttrain.report import load_run, render_report
from posttrain.report.plots import collect_series, ema, resolve_keys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rl_run(run_dir: Path, steps: int = 30) -> Path:
    """A GRPO-shaped run: eval records at steps 0 and `steps`, per-step RL metrics, sample files."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("algorithm: grpo\nrollout:\n  max_tokens: 24\n")
    rng = random.Random(0)
    with MetricsLogger(run_dir) as log:
        log.log(0, {"eval/accuracy": 0.1, "eval/reward_mean": 0.1, "eval/response_len_mean": 17.0})
        for step in range(1, steps + 1):
            reward = min(1.0, step / steps + rng.uniform(-0.2, 0.2))
            log.log(
                step,
                {
                    "reward/mean": reward,
                    "reward/std": 0.3,
                    "reward/numeric_match/mean": reward,
                    "reward/numeric_match/std": 0.3,
                    "response_len/mean": 20 - step / 3,
                    "response_len/max": 24.0,
                    "response_len/clipped_frac": 0.5,
                    "clip_frac/low": 0.0,
                    "clip_frac/high": 0.01,
                    "kl": 0.01 * step,
                    "entropy": 1.5 - step / 40,
                    "loss/policy": rng.gauss(0, 1e-3),
                    "grad_norm": 1 + rng.random(),
                    "lr": 3e-5,
                    "time/rollout_s": 6.0,
                    "time/reward_s": 0.01,
                    "time/update_s": 11.0,
                    "time/step_s": 17.5,
                    "memory/peak_rss_gb": 6.4,
                    "tokens/train_per_s": 140.0,
                    "approx_kl": math.nan if step == 3 else 0.0,
                    "reward/error": "ValueError: bad" if step == 2 else None,
                },
            )
        log.log(steps, {"eval/accuracy": 0.6, "eval/reward_mean": 0.6, "eval/response_len_mean": 12.0})
    for step in (0, steps):
        with open(run_dir / f"eval-step{step:05d}.jsonl", "w") as f:
            for i in range(3):
                prompt = [{"role": "user", "content": f"What is {i} + {i}? <b>"}]
                f.write(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "completion": f"{2 * i if step else i}",
                            "reward": float(step > 0),
                            "answer": str(2 * i),
                        }
                    )
                    + "\n"
                )
    return run_dir


def test_renders_html_and_pngs_from_an_rl_run(tmp_path: Path) -> None:
    run_dir = _rl_run(tmp_path / "run")
    page_path = render_report(run_dir)
    assert page_path == run_dir / "report.html"
    page = page_path.read_text()
    pngs = {p.stem for p in (run_dir / "plots").glob("*.png")}
    assert {
        "reward",
        "loss",
        "kl",
        "entropy",
        "response_length",
        "clipping",
        "accuracy",
        "optimization",
        "memory",
        "step_time",
    } <= pngs
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in (run_dir / "plots").glob("*.png"))
    assert page.count("data:image/png;base64,") == len(pngs)  # self-contained: every plot inlined
    assert "algorithm: grpo" in page  # the config
    assert "What is 1 + 1? &lt;b&gt;" in page  # samples by step, escaped
    assert "step 0" in page and "step 30" in page
    assert "ValueError: bad" in page  # text metrics listed
    assert "Headline numbers" in page and "eval/accuracy" in page


def test_headline_best_respects_direction(tmp_path: Path) -> None:
    from posttrain.report.html import headline_rows
    from posttrain.report.plots import PANELS

    series = collect_series(
        [
            {"step": 1, "loss": 3.0, "reward/mean": 0.1},
            {"step": 2, "loss": 1.0, "reward/mean": 0.9},
            {"step": 3, "loss": 2.0, "reward/mean": 0.5},
        ]
    )
    loss_panel = next(p for p in PANELS if p.name == "loss")
    reward_panel = next(p for p in PANELS if p.name == "reward")
    rows = {
        r["key"]: r
        for r in headline_rows([(loss_panel, tmp_path, ["loss"]), (reward_panel, tmp_path, ["reward/mean"])], series)
    }
    assert rows["loss"]["best"] == (1.0, 2) and rows["loss"]["first"] == 3.0 and rows["loss"]["last"] == 2.0
    assert rows["reward/mean"]["best"] == (0.9, 2)


def test_sft_run_gets_loss_with_eval_points_and_step_time(tmp_path: Path) -> None:
    run_dir = tmp_path / "sft"
    run_dir.mkdir()
    with MetricsLogger(run_dir) as log:
        for step in range(1, 6):
            record = {"loss": 2.0 / step, "grad_norm": 1.0, "lr": 1e-5, "step_time": 3.0, "tokens_per_s": 100.0}
            if step in (3, 5):
                record["eval_loss"] = 2.5 / step
            log.log(step, record)
    render_report(run_dir, tmp_path / "out")
    assert {p.stem for p in (tmp_path / "out" / "plots").glob("*.png")} >= {"loss", "step_time", "throughput"}
    assert not (run_dir / "report.html").exists()  # --out leaves the run directory alone


def test_old_metrics_files_read_under_the_one_schema(tmp_path: Path) -> None:
    """Runs logged before every trainer shared the metric names (SFT's step_time and tokens_per_s) plot and
    head the table exactly as a run logging today's time/step_s and tokens/train_per_s."""
    old = [{"step": s, "loss": 1.0 / s, "step_time": 2.0 + s, "tokens_per_s": 90.0 + s} for s in (1, 2, 3)]
    new = [{"step": s, "loss": 1.0 / s, "time/step_s": 2.0 + s, "tokens/train_per_s": 90.0 + s} for s in (1, 2, 3)]
    assert collect_series(old) == collect_series(new)
    for name, records in (("old", old), ("new", new)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        with MetricsLogger(run_dir) as log:
            for record in records:
                log.log(record["step"], {k: v for k, v in record.items() if k != "step"})
        page = render_report(run_dir).read_text()
        assert "time/step_s" in page and "step_time" not in page and "tokens_per_s" not in page
        assert {"step_time", "throughput"} <= {p.stem for p in (run_dir / "plots").glob("*.png")}


def test_duplicate_series_and_patterns() -> None:
    series = collect_series([{"step": 1, "reward/mean": 0.5, "reward/f/mean": 0.5, "reward/g/mean": 0.2}])
    assert resolve_keys(("reward/mean", "reward/*/mean"), series) == ["reward/mean", "reward/g/mean"]
    zeros = collect_series([{"step": 1, "clip_frac/low": 0.0, "clip_frac/high": 0.0}])
    assert resolve_keys(("clip_frac/low", "clip_frac/high"), zeros) == ["clip_frac/low", "clip_frac/high"]


def test_ema_skips_nan_and_is_debiased() -> None:
    out = ema([1.0, math.nan, 1.0, 3.0], span=3)
    assert out[0] == 1.0 and out[1] == 1.0 and 1.0 < out[3] < 3.0


def test_partial_last_line_is_skipped_with_a_note(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "loss": 1.0}\n{"step": 2, "ti')
    data = load_run(run_dir)
    assert len(data.records) == 1 and "incomplete last line" in data.notes[0]
    assert "incomplete last line" in render_report(run_dir).read_text()


def test_empty_metrics_renders_a_page(tmp_path: Path) -> None:
    run_dir = tmp_path / "new"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    assert "no metrics records yet" in render_report(run_dir).read_text()


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"step": 1, "loss": 1.0}\nnot json\n{"step": 3}\n', "metrics.jsonl:2: not a JSON record"),
        ("[1, 2]\n", "metrics.jsonl:1: expected a JSON object"),
        ('{"loss": 1.0}\n', "metrics.jsonl:1: 'step' must be an integer"),
    ],
)
def test_malformed_metrics_name_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    run_dir = tmp_path / "bad"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(content)
    with pytest.raises(PosttrainError, match=message):
        render_report(run_dir)


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["report", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_prints_the_report_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _rl_run(tmp_path / "run", steps=5)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r" / "report.html")

"""posttrain.metrics: metrics.jsonl records, non-finite values, crash tolerance, TensorBoard (the other trackers:
tests/trackers)."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.metrics import MetricsLogger, read_metrics


def test_log_appends_one_json_record_per_line(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"loss": 2.5, "lr": 1e-4, "tokens": 128, "phase": "warmup", "clipped": True})
        logger.log(2, {"loss": 2.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert {k: first[k] for k in ("loss", "lr", "tokens", "phase", "clipped")} == {
        "loss": 2.5,
        "lr": 1e-4,
        "tokens": 128,
        "phase": "warmup",
        "clipped": True,
    }
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_each_record_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(7, {"loss": 1.0})
    # Read with a separate handle while the logger is still open: a crash now would lose nothing.
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] == 1.0
    logger.close()


def test_tensors_and_numpy_scalars_become_python_numbers(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(
            0,
            {
                "t_float": torch.tensor(0.5),
                "t_int": torch.tensor(3),
                "t_one": torch.ones(1, 1, dtype=torch.float16),
                "t_grad": torch.tensor(2.0, requires_grad=True) * 2,
                "np_f32": np.float32(0.25),
                "np_i64": np.int64(9),
                "np_0d": np.array(1.5),
                "np_bool": np.bool_(True),
            },
        )
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["t_float"] == 0.5 and record["t_int"] == 3 and type(record["t_int"]) is int
    assert record["t_one"] == 1.0 and record["t_grad"] == 4.0
    assert record["np_f32"] == 0.25 and record["np_i64"] == 9 and record["np_0d"] == 1.5
    assert record["np_bool"] is True


def test_non_finite_floats_are_written_as_strings_and_read_back_as_floats(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"nan": float("nan"), "inf": math.inf, "ninf": torch.tensor(-math.inf), "ok": 1.0})
    raw = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(raw)["nan"] == "nan"  # strict JSON: no NaN literal in the file
    assert "NaN" not in raw and "Infinity" not in raw
    record = read_metrics(tmp_path)[0]
    assert math.isnan(record["nan"]) and record["inf"] == math.inf and record["ninf"] == -math.inf


def test_bad_metrics_are_refused(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match=r"'loss' must be a single number, got 2 values"):
            logger.log(0, {"loss": torch.ones(2)})
        with pytest.raises(TypeError, match=r"'cfg' must be a number or a string"):
            logger.log(0, {"cfg": {"a": 1}})
        with pytest.raises(ValueError, match=r"'step' is reserved"):
            logger.log(0, {"step": 1})
        with pytest.raises(TypeError, match=r"step must be an int"):
            logger.log(1.5, {"loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").read_text()


def test_log_after_close_fails_and_close_is_idempotent(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match=r"closed"):
        logger.log(0, {"loss": 1.0})


def test_resumed_run_appends(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"loss": 1.0})
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_read_metrics_skips_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]


def test_read_metrics_reports_a_corrupt_line_with_its_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(PosttrainError, match=rf"{path}:2: not a JSON record"):
        read_metrics(path)
    with pytest.raises(PosttrainError, match=r"metrics file not found"):
        read_metrics(tmp_path / "none.jsonl")


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    # None in sys.modules makes the import fail, as on a machine without tensorboard installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        PosttrainError, match=r"the tensorboard package is not installed: pip install 'posttrain\[tensorboard\]'"
    ):
        MetricsLogger(tmp_path, tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()


class FakeSummaryWriter:
    instances: list[FakeSummaryWriter] = []

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("how", [{"tensorboard": True}, {"report_to": ["tensorboard"]}, {"report_to": "tensorboard"}])
def test_tensorboard_gets_numeric_scalars_only(tmp_path, monkeypatch, how):
    fake_module = types.ModuleType("torch.utils.tensorboard")
    fake_module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_module)
    FakeSummaryWriter.instances.clear()
    with MetricsLogger(tmp_path, **how) as logger:
        logger.log(3, {"loss": 1.5, "tokens": 10, "phase": "rl", "flag": True, "bad": float("inf")})
    writer = FakeSummaryWriter.instances[0]
    assert writer.log_dir == str(tmp_path / "tensorboard")
    assert writer.scalars == [("loss", 1.5, 3), ("tokens", 10.0, 3), ("bad", math.inf, 3)]
    assert writer.closed

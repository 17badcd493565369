"""`model.dtype: auto` in the trainers: fp32 exactly as before on a CPU without fast bf16, bf16 autocast over fp32
master weights on one with it (both forced through POSTTRAIN_CPU_FEATURES, so they run on any CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.hardware import FEATURES_ENV
from posttrain.metrics import read_metrics
from posttrain.models.hub import load_model
from posttrain.trainers.sections import ModelSection
from posttrain.trainers.sft import SFTConfig, train_sft
from tests.trainers.test_sft import base_overrides

AVX2 = "avx avx2 fma"
ZEN5 = "avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"


def run_sft(model_dir: Path, data_file: Path, out: Path, dtype: str | None) -> tuple[list[dict], dict]:
    overrides = base_overrides(model_dir, data_file, out) + [
        "train.batch_size=4",
        "train.max_steps=2",
        "optim.lr=1e-2",
    ]
    if dtype is not None:
        overrides.append(f"model.dtype={dtype}")
    run = train_sft(load_config(SFTConfig, overrides=overrides))
    model, _ = load_model(run / "final", device="cpu")
    return read_metrics(run), model.state_dict()


def test_auto_is_the_default():
    assert ModelSection().dtype == "auto"


def test_auto_on_an_avx2_cpu_is_todays_fp32_bit_for_bit(model_dir, data_file, tmp_path, monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, AVX2)
    auto_metrics, auto_weights = run_sft(model_dir, data_file, tmp_path / "auto", None)  # the default: auto
    monkeypatch.delenv(FEATURES_ENV)
    fp32_metrics, fp32_weights = run_sft(model_dir, data_file, tmp_path / "fp32", "float32")
    assert [r["loss"] for r in auto_metrics] == [r["loss"] for r in fp32_metrics]
    for name, tensor in fp32_weights.items():
        assert torch.equal(auto_weights[name], tensor), name


def test_auto_on_a_fast_bf16_cpu_trains_in_bf16_over_fp32_weights(model_dir, data_file, tmp_path, monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, ZEN5)
    bf16_metrics, bf16_weights = run_sft(model_dir, data_file, tmp_path / "auto", "auto")
    monkeypatch.setenv(FEATURES_ENV, AVX2)
    fp32_metrics, fp32_weights = run_sft(model_dir, data_file, tmp_path / "fp32", "auto")
    # Master weights stay fp32; the bf16 forwards give other (close) losses, so autocast did run.
    assert all(t.dtype == torch.float32 for t in bf16_weights.values())
    first_bf16, first_fp32 = bf16_metrics[0]["loss"], fp32_metrics[0]["loss"]
    assert first_bf16 != first_fp32
    assert first_bf16 == pytest.approx(first_fp32, rel=2e-2)  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding


def test_an_explicit_dtype_is_never_autocast(monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, ZEN5)
    model = torch.nn.Module()
    model.device, model.dtype = torch.device("cpu"), torch.float32  # what autocast_dtype reads of a Transformer
    assert ModelSection(dtype="float32").autocast_dtype(model) is None
    assert ModelSection(dtype="auto").autocast_dtype(model) == torch.bfloat16
    model.dtype = torch.bfloat16  # bf16 weights: nothing to autocast over
    assert ModelSection(dtype="auto").autocast_dtype(model) is None


def test_an_unknown_dtype_names_the_key():
    with pytest.raises((ConfigError, ValueError), match="dtype"):
        load_config(SFTConfig, overrides=["model.dtype=float8"])

"""train.off_policy in the RL trainers: the modes and the tis_cap alias resolve as documented, auto corrects only
when the engine and the update compute in other dtypes (a bf16 update over an fp32 engine on a fast-bf16 CPU,
forced here through POSTTRAIN_CPU_FEATURES; bf16 rollouts for an fp32 update), and the weights' metrics reach the
step's record."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from posttrain.algos.importance import OffPolicyParams
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.hardware import FEATURES_ENV
from posttrain.trainers.rl import rl_step, setup_run
from posttrain.trainers.rl.config import GRPOConfig
from tests.trainers.rl_helpers import rl_overrides, tiny_model, tokenizer

ZEN5 = "avx2 fma avx512f avx512_bf16 avx512_vnni"


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _config(tmp_path: Path, name: str, *extra: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, rl_overrides(tmp_path, name, *extra))


@pytest.mark.parametrize(
    "extra, mismatch, want",
    [
        ([], False, None),
        ([], True, OffPolicyParams("tis", "token", cap=2.0)),
        (["train.off_policy.mode=none"], True, None),
        (["train.tis_cap=3.0"], False, OffPolicyParams("tis", "token", cap=3.0)),
        (
            ["train.off_policy.mode=tis", "train.off_policy.level=sequence", "train.off_policy.cap=1.5"],
            False,
            OffPolicyParams("tis", "sequence", cap=1.5),
        ),
        (
            ["train.off_policy.mode=mis", "train.off_policy.low=0.5", "train.off_policy.high=3"],
            True,
            OffPolicyParams("mis", "token", low=0.5, high=3.0),
        ),
    ],
)
def test_modes_resolve(tmp_path, extra, mismatch, want):
    assert _config(tmp_path, "cfg", *extra).train.off_policy_params(mismatch) == want


@pytest.mark.parametrize(
    "extra, match",
    [
        (["train.tis_cap=2.0", "train.off_policy.mode=mis"], "tis_cap or train.off_policy, not both"),
        (["train.off_policy.mode=clip"], "mode"),
        (["train.off_policy.low=3", "train.off_policy.high=2"], "low <= high"),
    ],
)
def test_bad_settings_fail_on_load(tmp_path, extra, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        _config(tmp_path, "bad", *extra)


@pytest.mark.parametrize(
    "features, extra, engine, update",
    [
        # a bf16 update (autocast on a fast-bf16 CPU) over an engine asked to stay fp32
        (ZEN5, ["rollout.engine.compute_dtype=float32"], "float32", "bfloat16"),
        # bf16 rollouts (bf16 copies of the fp32 policy) for an fp32 update, on any CPU
        ("avx2 fma", ["rollout.engine.compute_dtype=bfloat16"], "bfloat16", "float32"),
    ],
)
def test_auto_corrects_an_engine_in_another_dtype_than_the_update(
    tmp_path, tok, monkeypatch, caplog, features, extra, engine, update
):
    monkeypatch.setenv(FEATURES_ENV, features)
    with caplog.at_level(logging.INFO, logger="posttrain.trainers"):
        run = setup_run(_config(tmp_path, "mixed", *extra), "grpo", model=tiny_model(tok), tokenizer=tok)
    assert run.llm.compute_dtype == getattr(torch, engine)
    update_dtype = run.parallel.compute_autocast[1] if run.parallel.compute_autocast else run.model.dtype
    assert update_dtype == getattr(torch, update)
    assert run.objective.off_policy == OffPolicyParams("tis", "token", cap=2.0)
    said = [r.getMessage() for r in caplog.records if "rollout engine computes" in r.getMessage()]
    assert said == [
        f"posttrain: the rollout engine computes in {engine} and the update in {update}; off-policy "
        "correction: tis per token, cap 2.0 (train.off_policy)"
    ]
    metrics = rl_step(run, 1)
    # logprobs of one dtype against the other's: weights near 1, not exactly 1.
    assert metrics["mismatch/abs_diff_max"] > 0
    assert 0.5 < metrics["off_policy/weight_mean"] <= 2.0 and metrics["off_policy/weight_mean"] != 1.0
    assert 0 <= metrics["off_policy/truncated_frac"] <= 1 and metrics["off_policy/weight_max"] <= 2.0
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in run.model.parameters())


def test_on_a_fast_bf16_cpu_both_sides_compute_in_bf16_by_default(tmp_path, tok, monkeypatch):
    """model.dtype auto trains under bf16 autocast and rollout.engine.compute_dtype auto samples in bf16: one dtype,
    so auto applies no correction (mismatch/* still reports the gap); model.dtype=float32 keeps both in fp32."""
    monkeypatch.setenv(FEATURES_ENV, ZEN5)
    run = setup_run(_config(tmp_path, "bf16"), "grpo", model=tiny_model(tok), tokenizer=tok)
    assert run.parallel.compute_autocast == ("cpu", torch.bfloat16) and run.llm.compute_dtype == torch.bfloat16
    assert run.objective.off_policy is None
    run = setup_run(_config(tmp_path, "fp32", "model.dtype=float32"), "grpo", model=tiny_model(tok), tokenizer=tok)
    assert run.parallel.compute_autocast is None and run.llm.compute_dtype == torch.float32


def test_no_correction_where_both_compute_in_fp32(tmp_path, tok, monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, "avx2 fma")
    run = setup_run(_config(tmp_path, "fp32"), "grpo", model=tiny_model(tok), tokenizer=tok)
    assert run.parallel.compute_autocast is None and run.objective.off_policy is None
    assert not any(key.startswith("off_policy/") for key in rl_step(run, 1))


def test_masked_is_logs_its_masked_share(tmp_path, tok, monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, "avx2 fma")
    # A band so narrow around 1 that the engine's and the trainer's fp32 logprobs (equal to ~1e-6) still fall
    # inside it, then one (recompute: pi_old is the trainer's) outside of which nothing is kept.
    extra = ["train.off_policy.mode=mis", "train.old_logprobs=recompute"]
    run = setup_run(
        _config(tmp_path, "mis", *extra, "train.off_policy.high=1.01"), "grpo", model=tiny_model(tok), tokenizer=tok
    )
    metrics = rl_step(run, 1)
    assert metrics["off_policy/masked_frac"] == 0.0 and metrics["off_policy/weight_mean"] == 1.0
    extra += ["train.off_policy.low=1.5", "train.off_policy.high=2"]
    run = setup_run(_config(tmp_path, "mis-all", *extra), "grpo", model=tiny_model(tok), tokenizer=tok)
    metrics = rl_step(run, 1)
    assert metrics["off_policy/masked_frac"] == 1.0 and metrics["off_policy/weight_mean"] == 0.0
    assert math.isfinite(metrics["loss/policy"]) and metrics["loss/policy"] == 0.0

"""train.off_policy in the RL trainers: the modes and the tis_cap alias resolve as documented, auto corrects only
when the engine and the update compute in other dtypes (a bf16 update over the fp32 engine on a fast-bf16 CPU,
forced here through POSTTRAIN_CPU_FEATURES), and the weights' metrics reach the step's record."""

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


def test_auto_corrects_a_bf16_update_over_the_fp32_engine(tmp_path, tok, monkeypatch, caplog):
    monkeypatch.setenv(FEATURES_ENV, ZEN5)
    with caplog.at_level(logging.INFO, logger="posttrain.trainers"):
        run = setup_run(_config(tmp_path, "bf16"), "grpo", model=tiny_model(tok), tokenizer=tok)
    assert run.parallel.compute_autocast == ("cpu", torch.bfloat16) and run.llm.compute_dtype == torch.float32
    assert run.objective.off_policy == OffPolicyParams("tis", "token", cap=2.0)
    said = [r.getMessage() for r in caplog.records if "rollout engine computes" in r.getMessage()]
    assert said == [
        "posttrain: the rollout engine computes in float32 and the update in bfloat16; off-policy "
        "correction: tis per token, cap 2.0 (train.off_policy)"
    ]
    metrics = rl_step(run, 1)
    # bf16 logprobs against the engine's fp32 ones: weights near 1, not exactly 1.
    assert metrics["mismatch/abs_diff_max"] > 0
    assert 0.5 < metrics["off_policy/weight_mean"] <= 2.0 and metrics["off_policy/weight_mean"] != 1.0
    assert 0 <= metrics["off_policy/truncated_frac"] <= 1 and metrics["off_policy/weight_max"] <= 2.0
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in run.model.parameters())


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

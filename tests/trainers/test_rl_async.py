"""Asynchronous rollouts in one process (rollout.mode=async): k = 0 is the sync run (same samples, losses and
weights), k >= 1 never trains on a sample older than k versions, every token records the version it was drawn
under, and a failing rollout thread stops the run with one clear error."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.trainers.rl import rl_step, setup_run
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from tests.trainers.rl_helpers import rl_overrides, tiny_model, tokenizer

LOSS_KEYS = ("loss", "loss/policy", "reward/mean", "grad_norm")


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _run(tmp_path: Path, tok, name: str, config=GRPOConfig, steps: int = 3, *extra: str):
    cfg = load_config(config, None, rl_overrides(tmp_path, name, "optim.lr=1e-2", *extra))
    run = setup_run(cfg, "grpo" if config is GRPOConfig else "ppo", model=tiny_model(tok), tokenizer=tok)
    records, batches = [], []
    try:
        for step in range(1, steps + 1):
            records.append(rl_step(run, step))
    finally:
        if run.async_rollout is not None:
            run.async_rollout.close()
    return run, records


@pytest.mark.parametrize("config", [GRPOConfig, PPOConfig], ids=["grpo", "ppo"])
def test_async_k0_is_the_sync_run(tmp_path: Path, tok, config) -> None:
    extra = ["rollout.prompts_per_step=4", "train.minibatch_size=8"] if config is PPOConfig else []
    sync, sync_records = _run(tmp_path, tok, "sync", config, 3, "rollout.seed_prompts=true", *extra)
    lazy, async_records = _run(
        tmp_path, tok, "async", config, 3, "rollout.mode=async", "rollout.max_staleness=0", *extra
    )
    for a, b in zip(sync_records, async_records):
        for key in LOSS_KEYS:
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=0, abs_tol=1e-6), (key, a[key], b[key])
        assert b["async/staleness_0"] == a["num_samples"] and b["async/stale_dropped"] == 0
    for p, q in zip(sync.model.parameters(), lazy.model.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)

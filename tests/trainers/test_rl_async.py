"""Asynchronous rollouts in one process (rollout.mode=async): k = 0 is the sync run (same samples, losses and
weights), k >= 1 never trains on a sample older than k versions (also when the rollout is let run too far ahead:
the stale groups are dropped and regenerated), and a failing or hanging rollout thread stops the run with one
clear error, its checkpoints intact."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

import posttrain.trainers.rl.step as rl_step_module
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.rollout.batch import PROMPT_KEY
from posttrain.rollout.producer import RolloutWorkerError
from posttrain.trainers.rl import rl_step, setup_run, train_grpo
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from tests.trainers.rl_helpers import rl_overrides, tiny_model, tokenizer

LOSS_KEYS = ("loss", "loss/policy", "loss/value", "reward/mean", "response_len/mean", "grad_norm")


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _steps(tmp_path: Path, tok, name: str, config=GRPOConfig, steps: int = 2, extra: tuple[str, ...] = ()):
    cfg = load_config(config, None, rl_overrides(tmp_path, name, "optim.lr=1e-2", *extra))
    run = setup_run(cfg, "grpo" if config is GRPOConfig else "ppo", model=tiny_model(tok), tokenizer=tok)
    records = []
    try:
        for step in range(1, steps + 1):
            records.append(rl_step(run, step))
    finally:
        if run.async_rollout is not None:
            run.async_rollout.close()
    return run, records


@pytest.mark.parametrize("config", [GRPOConfig, PPOConfig], ids=["grpo", "ppo"])
def test_async_k0_is_the_sync_run(tmp_path: Path, tok, config) -> None:
    extra = ("rollout.prompts_per_step=4", "train.minibatch_size=8") if config is PPOConfig else ()
    sync, sync_records = _steps(tmp_path, tok, "sync", config, extra=("rollout.seed_prompts=true", *extra))
    lazy, async_records = _steps(
        tmp_path, tok, "async", config, extra=("rollout.mode=async", "rollout.max_staleness=0", *extra)
    )
    for a, b in zip(sync_records, async_records):
        for key in LOSS_KEYS:
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=0, abs_tol=1e-6), (key, a[key], b[key])
        assert b["async/staleness_0"] == a["num_samples"] and b["async/stale_dropped"] == 0
        assert b["policy_version"] == a["policy_version"] and b["rollout_policy_version"] == a["rollout_policy_version"]
    for p, q in zip(sync.model.parameters(), lazy.model.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)


def _slow_update(monkeypatch, seconds: float) -> None:
    update = rl_step_module.update_policy

    def slow(*args, **kwargs):
        time.sleep(seconds)  # the rollout thread runs ahead meanwhile
        return update(*args, **kwargs)

    monkeypatch.setattr(rl_step_module, "update_policy", slow)


def test_k1_never_trains_on_older_samples(tmp_path: Path, tok, monkeypatch) -> None:
    _slow_update(monkeypatch, 0.3)
    run, records = _steps(tmp_path, tok, "k1", steps=4, extra=("rollout.mode=async", "rollout.max_staleness=1"))
    for record in records:
        assert record["async/staleness_max"] <= 1 and record["async/stale_dropped"] == 0
        assert record["async/staleness_0"] + record["async/staleness_1"] == record["num_samples"]
        assert record["policy_version"] - record["rollout_policy_version"] <= 2  # used at version - 1 at most
        assert "off_policy/weight_mean" in record  # auto: TIS on for stale samples
        assert 0 <= record["async/weight_sync_s"] < 60
    # With a slow update the next step's batch was drawn while the update ran: one version old.
    assert sum(r["async/staleness_1"] for r in records[1:]) > 0


def test_a_rollout_let_run_too_far_ahead_is_filtered(tmp_path: Path, tok, monkeypatch) -> None:
    """The rollout runs 3 steps ahead (more than k = 1 allows): the filter drops every group with a sample older
    than the bound and regenerates it, so the update still never sees one."""
    monkeypatch.setattr("posttrain.trainers.rl.async_rollout.lead_steps", lambda cfg: 3)
    _slow_update(monkeypatch, 0.3)
    _, records = _steps(tmp_path, tok, "ahead", steps=4, extra=("rollout.mode=async", "rollout.max_staleness=1"))
    assert sum(r["async/stale_dropped"] for r in records) > 0
    for record in records:
        assert record["async/staleness_max"] <= 1
        assert sum(record[f"async/staleness_{i}"] for i in (0, 1)) == record["num_samples"] == 8


def test_tail_fill_starts_the_next_step_early_within_the_bound_and_on_its_own_prompts(
    tmp_path: Path, tok, monkeypatch
) -> None:
    """rollout.async_fill: the next step's prompts join the engine during the current step's collection (k = 1 lets
    the rollout run one step ahead); each step still trains on exactly its own prompts, within the bound."""
    _slow_update(monkeypatch, 0.3)
    collect = rl_step_module.collect_step
    prompts: dict[str, dict[int, list]] = {"fill": {}, "off": {}}
    name = ["fill"]

    def recording(run, step, fill=None):
        produced = collect(run, step, fill)
        prompts[name[0]][step] = [row[PROMPT_KEY] for row in produced.batch.rows]
        return produced

    monkeypatch.setattr(rl_step_module, "collect_step", recording)
    k1 = ("rollout.mode=async", "rollout.max_staleness=1")
    _, records = _steps(tmp_path, tok, "fill", steps=3, extra=(*k1, "rollout.async_fill=1"))
    name[0] = "off"
    _, plain = _steps(tmp_path, tok, "off", steps=3, extra=(*k1, "rollout.async_fill=0"))
    assert records[1]["async/tail_filled"] == 1.0  # step 2's prompts were submitted during step 1's collection
    assert "async/tail_filled" not in plain[1]
    for record in records:
        assert record["async/staleness_max"] <= 1 and record["async/stale_dropped"] == 0
        assert record["async/staleness_0"] + record["async/staleness_1"] == record["num_samples"]
    # the steps trained (the producer may have collected a step or two past the last before it was closed: racy)
    trained = range(1, 4)
    assert [prompts["fill"][s] for s in trained] == [prompts["off"][s] for s in trained]


def test_a_failing_rollout_thread_stops_the_run_with_one_error(tmp_path: Path, tok, monkeypatch) -> None:
    collect = rl_step_module.collect_step

    def failing(run, step, fill=None):
        if step == 3:
            raise OSError("the reward sandbox is gone")
        return collect(run, step, fill)

    monkeypatch.setattr(rl_step_module, "collect_step", failing)
    overrides = rl_overrides(tmp_path, "fail", "rollout.mode=async", "train.max_steps=4", "train.save_every=1")
    cfg = load_config(GRPOConfig, None, overrides)
    with pytest.raises(RolloutWorkerError, match="failed while collecting step 3: OSError: the reward sandbox is gone"):
        train_grpo(cfg, model=tiny_model(tok), tokenizer=tok)
    checkpoints = tmp_path / "fail" / "checkpoints"
    assert (checkpoints / "step-2" / "model.safetensors").is_file() and not (checkpoints / "step-3").exists()


def test_resume_collects_the_next_step_again_from_the_checkpoint(tmp_path: Path, tok) -> None:
    """In-flight samples are not saved: the checkpoint after step 1 holds the prompt source as it was before step
    2's draws (although the rollout thread had drawn them already), and a resumed async run collects step 2 again,
    seeded, at the checkpoint's weights: the step 2 a sync run resumed from its own step-1 checkpoint takes (step 1
    is the same in both: its samples are on-policy)."""
    tis = ("train.off_policy.mode=tis", "optim.lr=1e-2", "train.max_steps=2")
    resumed = {}
    for name, mode in (("async", ("rollout.mode=async",)), ("sync", ("rollout.seed_prompts=true",))):
        first = rl_overrides(tmp_path, f"first-{name}", "train.save_every=1", *tis, *mode)
        train_grpo(load_config(GRPOConfig, None, first), model=tiny_model(tok), tokenizer=tok)
        checkpoint = tmp_path / f"first-{name}" / "checkpoints" / "step-1"
        overrides = rl_overrides(tmp_path, f"resumed-{name}", f"resume={checkpoint}", *tis, *mode)
        run = setup_run(load_config(GRPOConfig, None, overrides), "grpo", model=tiny_model(tok), tokenizer=tok)
        assert run.start_step == 1
        try:
            resumed[name] = rl_step(run, 2)
        finally:
            if run.async_rollout is not None:
                run.async_rollout.close()
    for key in LOSS_KEYS:
        if key in resumed["sync"]:
            assert math.isclose(resumed["async"][key], resumed["sync"][key], rel_tol=0, abs_tol=1e-6), key
    assert resumed["async"]["async/staleness_0"] == resumed["async"]["num_samples"]


def test_a_hanging_rollout_thread_times_out(tmp_path: Path, tok, monkeypatch) -> None:
    monkeypatch.setattr(rl_step_module, "collect_step", lambda run, step, fill=None: time.sleep(30))
    cfg = load_config(
        GRPOConfig, None, rl_overrides(tmp_path, "hang", "rollout.mode=async", "rollout.async_timeout_s=1")
    )
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    started = time.perf_counter()
    with pytest.raises(RolloutWorkerError, match="no rollout batch for step 1 within 1 s"):
        rl_step(run, 1)
    assert time.perf_counter() - started < 10


def test_async_keys_from_the_command_line(tmp_path: Path) -> None:
    cfg = load_config(GRPOConfig, None, ["rollout.mode=async", "rollout.max_staleness=2", "rollout.async_threads=1"])
    assert (cfg.rollout.mode, cfg.rollout.max_staleness, cfg.rollout.async_threads) == ("async", 2, 1)
    with pytest.raises(ConfigError, match="max_staleness must be an integer >= 0"):
        load_config(GRPOConfig, None, ["rollout.max_staleness=-1"])
    assert load_config(GRPOConfig, None, ["rollout.running_kv=recompute"]).rollout.running_kv == "recompute"
    with pytest.raises(ConfigError, match="rollout.running_kv: must be one of 'keep', 'recompute'; got 'drop'"):
        load_config(GRPOConfig, None, ["rollout.running_kv=drop"])
    assert load_config(GRPOConfig, None, ["rollout.async_fill=0"]).rollout.async_fill == 0
    with pytest.raises(ConfigError, match=r"async_fill must be a number in \[0, 1\] \(0: off\), got 1.5"):
        load_config(GRPOConfig, None, ["rollout.async_fill=1.5"])
    with pytest.raises(ConfigError, match="decoupled needs pi_old recomputed"):
        load_config(GRPOConfig, None, ["train.off_policy.mode=decoupled", "train.old_logprobs=rollout"])


def test_the_async_update_leaves_the_engines_native_decode_step_on(tmp_path: Path, tok) -> None:
    """The update's claims inside its forward and backward are per-thread saved-tensor hooks, not module hooks: the
    rollout thread's decode steps still run natively (the native step refuses modules with forward hooks)."""
    small = ("rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.minibatch_size=4")
    sync, _ = _steps(tmp_path, tok, "sync", extra=small)
    if sync.llm.engine.runner.native_decode is None or sync.llm.engine.runner.native_decode.steps == 0:
        pytest.skip("no native decode step here (no kernel library)")
    lazy, _ = _steps(tmp_path, tok, "async", extra=("rollout.mode=async", "rollout.max_staleness=1", *small))
    assert lazy.llm.engine.runner.native_decode.steps >= sync.llm.engine.runner.native_decode.steps // 2

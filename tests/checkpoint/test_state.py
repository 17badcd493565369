"""The pieces of exact resume: optimizer and RNG state round trips, the resumable batch stream, the
checkpoint's commit marker and rotation, and loading without pickle."""

from __future__ import annotations

import json
import logging
import pickle
import random
from pathlib import Path

import numpy
import pytest
import torch

from posttrain.checkpoint.optim_state import load_optimizer_plain, optimizer_to_plain
from posttrain.checkpoint.resume import open_run, truncate_metrics
from posttrain.checkpoint.rng_state import capture_rank_rngs, capture_rng, restore_rank_rng, restore_rng
from posttrain.checkpoint.save import COMMIT_MARKER, checkpoint_dir, latest_checkpoint, list_checkpoints
from posttrain.checkpoint.state import Checkpointer
from posttrain.config import load_config
from posttrain.errors import CheckpointError, ConfigError
from posttrain.peft import LoraConfig, apply_lora
from posttrain.trainers.loop import batch_stream
from posttrain.trainers.optim import build_optimizer, optimizer_step
from posttrain.trainers.schedule import build_scheduler
from posttrain.trainers.sft import SFTConfig
from tests.data.tiny import tiny_model, tiny_tokenizer


def train_a_little(model: torch.nn.Module, optimizer, scheduler, steps: int) -> None:
    ids = torch.arange(12).reshape(2, 6) % 300
    for _ in range(steps):
        model(ids).float().square().mean().backward()
        optimizer_step(optimizer, scheduler, 1.0)


def setup(lora: bool = False, lr: float = 1e-2):
    model = tiny_model()
    if lora:
        apply_lora(model, LoraConfig(r=4, dropout=0.1))
    optimizer = build_optimizer(model, lr, weight_decay=0.1)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=2, schedule="cosine")
    return model, optimizer, scheduler


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_optimizer_state_round_trips_bitwise():
    model, optimizer, scheduler = setup()
    train_a_little(model, optimizer, scheduler, 2)
    plain, tensors = optimizer_to_plain(optimizer)
    twin, twin_optimizer, _ = setup()
    twin.load_state_dict(model.state_dict())
    load_optimizer_plain(twin_optimizer, plain, tensors, "test")
    assert twin_optimizer.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
    for a, b in ((optimizer, twin_optimizer),):
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(a.state[p][key], b.state[q][key])
    with pytest.raises(CheckpointError, match="parameters per group"):
        load_optimizer_plain(build_optimizer(torch.nn.Linear(2, 2), 1e-3), plain, tensors, "test")


def test_rng_states_come_back():
    plain, tensors = capture_rng()
    drawn = (random.random(), numpy.random.rand(), torch.rand(3))
    restore_rng(plain, tensors, "test")
    again = (random.random(), numpy.random.rand(), torch.rand(3))
    assert drawn[0] == again[0] and drawn[1] == again[1] and torch.equal(drawn[2], again[2])


def test_rank_rng_states_come_back_per_rank_and_in_the_older_format():
    plain, tensors = capture_rank_rngs()  # one process: world size 1, rank 0's own
    assert plain["world_size"] == 1 and sorted(tensors) == ["rank0.torch_cpu"]
    drawn = torch.rand(3)
    restore_rank_rng(plain, tensors, "test", rank=0, world_size=1)
    assert torch.equal(torch.rand(3), drawn)
    # A rank the checkpoint has no state for keeps its own streams (here: the generator as it stands).
    now = torch.get_rng_state()
    restore_rank_rng(plain, tensors, "test", rank=1, world_size=2)
    assert torch.equal(torch.get_rng_state(), now)
    # A checkpoint written before every rank's state was kept: its one state, on any rank.
    old_plain, old_tensors = capture_rng()
    drawn = torch.rand(3)
    restore_rank_rng(old_plain, old_tensors, "test", rank=1, world_size=2)
    assert torch.equal(torch.rand(3), drawn)


def test_batch_stream_resumes_at_any_batch():
    items = list(range(7))
    whole = batch_stream(items, 3, seed=4)
    first = [next(whole) for _ in range(6)]  # crosses two epoch ends
    resumed = batch_stream(items, 3, seed=4)
    resumed.load_state_dict({"position": 4})
    assert [next(resumed) for _ in range(2)] == first[4:]
    assert whole.state_dict() == {"position": 6}


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointer_restores_everything_without_pickle(tmp_path: Path, monkeypatch, lora: bool):
    torch.manual_seed(0)
    model, optimizer, scheduler = setup(lora)
    stream = batch_stream(list(range(5)), 2, seed=0)
    head = torch.nn.Linear(4, 1)  # a module trained beside the model (rm's score head, ppo's value head)
    keep = Checkpointer(
        "sft",
        tmp_path,
        model,
        tiny_tokenizer(),
        "base",
        optimizer,
        scheduler,
        modules={"head": head},
        state={"data": stream},
    )
    train_a_little(model, optimizer, scheduler, 3)
    next(stream)
    path = keep.save(3)
    assert (path / COMMIT_MARKER).is_file() and not list(path.glob("*.bin")) and not list(path.glob("*.pt"))
    assert (path / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    train_a_little(model, optimizer, scheduler, 2)  # where the run goes on from step 3
    expected, expected_rng = params(model), torch.rand(4)

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for target, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    fresh, fresh_optimizer, fresh_scheduler = setup(lora)
    fresh_stream = batch_stream(list(range(5)), 2, seed=0)
    fresh_head = torch.nn.Linear(4, 1)
    again = Checkpointer(
        "sft",
        tmp_path,
        fresh,
        tiny_tokenizer(),
        "base",
        fresh_optimizer,
        fresh_scheduler,
        modules={"head": fresh_head},
        state={"data": fresh_stream},
    )
    assert again.restore(path) == 3
    assert fresh_stream.position == 1 and fresh_scheduler.last_epoch == 3
    assert torch.equal(fresh_head.weight, head.weight) and torch.equal(fresh_head.bias, head.bias)
    train_a_little(fresh, fresh_optimizer, fresh_scheduler, 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, params(fresh)))
    assert torch.equal(torch.rand(4), expected_rng)
    with pytest.raises(CheckpointError, match="cannot resume `posttrain dpo`"):
        Checkpointer("dpo", tmp_path, fresh, None, "base", fresh_optimizer).restore(path)


def test_commit_marker_rotation_and_torn_checkpoints(tmp_path: Path, caplog):
    model, optimizer, scheduler = setup()
    keep = Checkpointer("sft", tmp_path, model, None, "base", optimizer, scheduler, keep_last=2)
    for step in (1, 2, 3):
        keep.save(step)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    # A kill between the rename and the marker: step 4 exists but is torn, and does not count for rotation.
    torn = keep.save(4)
    (torn / COMMIT_MARKER).unlink()
    keep.save(2)  # overwrites an existing step dir whole (as after resuming from an older step)
    with caplog.at_level(logging.WARNING, logger="posttrain.trainers"):
        assert latest_checkpoint(tmp_path) == (3, checkpoint_dir(tmp_path, 3))
    assert "step-4: no COMMITTED marker" in caplog.text
    keep.save(5)  # after the commit: torn step 4 and the oldest committed ones go
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 5]
    assert not list((tmp_path / "checkpoints").glob(".*")), "no partial directories are left behind"


def test_open_run_resolves_resume(tmp_path: Path):
    def cfg(*overrides: str) -> SFTConfig:
        return load_config(SFTConfig, None, ["data.path=x.jsonl", *overrides])

    with pytest.raises(ConfigError, match="resume=auto needs out="):
        open_run("sft", cfg("resume=auto"))
    start = open_run("sft", cfg(f"out={tmp_path / 'run'}", "resume=auto"))
    assert start.checkpoint is None
    assert "resume: null" in (start.run_dir / "config.yaml").read_text(), "config.yaml describes the run, not the start"
    elsewhere = tmp_path / "loose"
    elsewhere.mkdir()
    (elsewhere / COMMIT_MARKER).write_text("")
    with pytest.raises(ConfigError, match="pass out="):
        open_run("sft", cfg(f"resume={elsewhere}"))


def test_truncate_metrics_drops_records_after_the_checkpoint(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    truncate_metrics(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'


def test_jsonl_prompt_source_resumes_its_order(tmp_path: Path):
    from posttrain.rollout.prompts import DatasetPrompts
    from posttrain.trainers.rl.config import DataSection

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(5)))
    cfg = DataSection(task=None, path=str(path), eval_size=0)
    source = DatasetPrompts(cfg)
    source.sample(3)
    state = json.loads(json.dumps(source.state_dict()))  # as the checkpoint stores it
    expected = source.sample(6)  # crosses into the next reshuffled pass
    again = DatasetPrompts(cfg)
    again.load_state_dict(state)
    assert again.sample(6) == expected

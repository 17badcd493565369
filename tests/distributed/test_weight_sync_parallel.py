"""Weight broadcast to a rollout process: after every optimizer step the receiver's parameters equal the
trainer's bit for bit, full and adapter-only, and adapter-only sends the adapter bytes and no more.

Two processes (torch.multiprocessing, gloo over a TCP store on a free port): the trainer takes AdamW steps on a
tiny random model and broadcasts; the receiver starts from other random weights (other adapters, or another
model altogether for a full sync), so only the broadcast can make them equal. Each writes its parameters
after every sync; the test compares the files."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.distributed.weight_sync import WeightBroadcast, synced_parameters
from posttrain.models.transformer import Transformer
from posttrain.peft import LoraConfig, apply_lora, lora_state_dict
from tests.data.tiny import tiny_model_config

STEPS = 3


def _model(seed: int, lora: bool, adapter_seed: int) -> Transformer:
    cfg = tiny_model_config(vocab_size=128)  # a tied LM head: sent once
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if lora:
        torch.manual_seed(adapter_seed)
        apply_lora(model, LoraConfig(r=4, alpha=8.0))
        for layer_adapter in lora_state_dict(model).values():  # B starts at zero: make both sides differ
            layer_adapter.normal_(0, 0.1)
    return model


def _worker(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    for lora in (False, True):  # one pair of processes for both: starting one costs seconds of imports
        _train_or_receive(rank, group, lora, Path(out) / ("adapters" if lora else "full"))


def _train_or_receive(rank: int, group: dist.ProcessGroup, lora: bool, out: Path) -> None:
    # The same base with adapters (a frozen base is never sent); other weights altogether without them.
    model = _model(seed=0 if lora else rank, lora=lora, adapter_seed=rank + 1)
    sync = WeightBroadcast(synced_parameters(model, "trainable"), group, bucket_mb=0.01)  # several buckets
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        if rank == 0:
            model(ids).logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = sync.send(version=step + 1)
        else:
            stats = sync.receive()
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in model.named_parameters()},
                "bytes": stats.bytes,
                "version": stats.version,
                "buckets": len(sync.buckets),
            },
            out / f"rank{rank}-step{step}.pt",
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sync")
    for mode in ("full", "adapters"):
        (out / mode).mkdir()
    mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=2, start_method="spawn")
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "adapters"])
def test_broadcast_weights_equal_the_trainers_bit_for_bit_after_every_step(lora, synced):
    tmp_path = synced / ("adapters" if lora else "full")
    first = torch.load(tmp_path / "rank1-step0.pt")["params"]
    for step in range(STEPS):
        sent, got = (torch.load(tmp_path / f"rank{r}-step{step}.pt") for r in (0, 1))
        assert sent["version"] == got["version"] == step + 1
        assert sorted(sent["params"]) == sorted(got["params"])
        for name, tensor in sent["params"].items():
            assert torch.equal(tensor, got["params"][name]), (step, name)
        if step:  # the steps moved the weights: each sync carried new values
            assert any(not torch.equal(first[k], got["params"][k]) for k in first)
    model = _model(0, lora, 1)
    if lora:
        adapter_bytes = sum(t.numel() * t.element_size() for t in lora_state_dict(model).values())
        assert got["bytes"] == adapter_bytes  # the adapters only: the frozen base stays where it is
    else:
        whole = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
        assert got["bytes"] == whole
    assert got["buckets"] > 1

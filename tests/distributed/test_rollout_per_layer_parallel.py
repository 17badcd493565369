"""`dist.rollout_weights=per_layer` on CPU (gloo): the engine's forwards gather FSDP2's layer shards one layer at a
time, in lockstep over the ranks, and sample what whole weights sample.

The prompts differ in length and the engine prefills at most 8 tokens a step, so the two ranks' rollouts take
different numbers of engine steps: the rank done first runs idle forwards (`rollout/idle_forwards` > 0) while
the other finishes. Without them the ranks' all-gathers fall out of step and the run hangs (the launcher's
timeout turns that into a failure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.trainers.rl import train_grpo
from posttrain.trainers.rl.config import GRPOConfig
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.distributed.rl_setup import LR, rl_overrides
from tests.numeric import EQUIVALENCE_EPS

COMPARED = ("reward/mean", "response_len/mean", "loss", "grad_norm")
SAMPLED = ("num_samples", "reward/mean", "response_len/mean")
WORDS = "the quick brown fox jumps over a lazy dog".split()


def uneven_prompts(path: Path, rows: int = 8) -> Path:
    """Prompts of 3, 14, 25, ... words (about 45 to 120 tokens once templated)."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            words = " ".join(WORDS[j % len(WORDS)] for j in range(3 + 11 * i))
            f.write(json.dumps({"prompt": f"Repeat: {words}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("per-layer")
    return rl_overrides(
        root,
        "rollout.samples_per_prompt=4",
        "train.micro_batch_size=4",
        "kl.beta=0.1",
        "data.task=null",
        f"data.path={uneven_prompts(root / 'prompts.jsonl')}",
        "rollout.engine.max_num_seqs=8",
        "rollout.engine.max_num_batched_tokens=8",
    )


@pytest.fixture(scope="module")
def one_process(overrides, tmp_path_factory) -> Path:
    return train_grpo(load_config(GRPOConfig, None, [*overrides, f"out={tmp_path_factory.mktemp('one') / 'run'}"]))


@pytest.fixture(scope="module")
def whole(overrides, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    torchrun(2, ["grpo", *overrides, f"out={out}", "dist.strategy=fsdp2"])
    return out


def test_per_layer_gathers_sample_and_update_as_whole_weights(overrides, one_process, whole, tmp_path):
    out = tmp_path / "run"
    torchrun(
        2, ["grpo", *overrides, f"out={out}", "dist.strategy=fsdp2", "dist.rollout_weights=per_layer"], timeout=240
    )
    got, want, single = read_metrics(out), read_metrics(whole), read_metrics(one_process)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [r["step"] for r in single] == [1, 2]
    # The ranks did take different numbers of engine steps: the lockstep had idle forwards to run.
    assert got[0]["rollout/idle_forwards"] > 0
    # Against whole weights on the same 2 ranks: the same ops in the same order (the gathers move values, they
    # do not compute), so the same numbers.
    for mine, theirs in zip(got, want):
        assert mine["num_samples"] == theirs["num_samples"] == 16
        assert all(mine[key] == theirs[key] for key in COMPARED), (mine["step"], mine, theirs)
    weights = final_weights(out)
    assert max_difference(weights, final_weights(whole)) == 0
    # Against one process: the reordered sums of 2 ranks (tests/distributed/equivalence.py).
    assert_same_steps(got, single, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"], sampled=SAMPLED)
    assert_same_weights(weights, final_weights(one_process), lr=LR, eps=EQUIVALENCE_EPS, updates=2)

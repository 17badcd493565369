"""SFT data-parallel on CPU (gloo): 2 processes against 1 on the same global batch, and an FSDP2 run resumed
on 1 process. Each multi-process run is a real `torchrun ... -m posttrain sft` (or the `--nproc` shortcut)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors
from posttrain.trainers.sft import SFTConfig, train_sft
from tests.data.tiny import save_tiny_model_dir, write_qa_jsonl
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import ROOT, final_weights, max_difference, torchrun
from tests.numeric import EQUIVALENCE_EPS

LR = 1e-2


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    """A YAML config over a tiny random model and 8 rows: a global batch of 4 rows x 2 accumulation steps; eps:
    AdamW's gain on the rounding 2 processes change (tests/numeric.py)."""
    root = tmp_path_factory.mktemp("sft-dist")
    model_dir = save_tiny_model_dir(root / "model")
    data = write_qa_jsonl(root / "qa.jsonl")
    config = root / "sft.yaml"
    config.write_text(
        f"model: {{name_or_path: {model_dir}}}\n"
        f"data: {{path: {data}, columns: {{prompt: question, completion: answer}}, as_chat: true}}\n"
        "train: {progress: false, batch_size: 4, grad_accum: 2, max_steps: 1}\n"
        f"optim: {{lr: {LR}, eps: {EQUIVALENCE_EPS}}}\n"
    )
    return config


@pytest.fixture(scope="module")
def one_process(config_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    return train_sft(load_config(SFTConfig, config_file, overrides=[f"out={out}"]))


def _nproc_shortcut(argv: list[str]) -> None:
    """`python -m posttrain sft CONFIG ... --nproc 2`: the shortcut that relaunches itself under torchrun."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "sft", *argv, "--nproc", "2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-6000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_step_of_one(strategy, config_file, one_process, tmp_path):
    out = tmp_path / "run"
    argv = [str(config_file), f"out={out}", f"dist.strategy={strategy}"]
    if strategy == "ddp":
        _nproc_shortcut(argv)
    else:
        torchrun(2, ["sft", *argv])
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1]  # rank 0 alone writes, the metrics reduced over both ranks
    reference_records = read_metrics(one_process)
    assert records[0]["tokens"] == reference_records[0]["tokens"]
    # AdamW hardly sees the gradient's scale, the norm does: the ranks' reduction must give the 1-process gradient.
    assert_same_steps(records, reference_records, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])
    initial = read_safetensors(Path(load_config(SFTConfig, config_file).model.name_or_path))
    reference = final_weights(one_process)
    assert max_difference(initial, reference) > 1e-3  # the step moved the weights: the comparison means something
    assert_same_weights(final_weights(out), reference, lr=LR, eps=EQUIVALENCE_EPS, updates=1)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_process_run_resumes_on_one_process(strategy, config_file, tmp_path):
    """4 steps on 2 ranks with a checkpoint at step 2; resumed from it by 1 process, steps 3 and 4 give the same
    losses and the same final weights. DDP: rank 0 wrote the usual whole-weights checkpoint. FSDP2: every rank
    its DCP shards, resumed both by a plain process and by FSDP2 on 1 rank (resharded to the reader's layout)."""
    two = tmp_path / "two"
    steps = ["train.max_steps=4", "train.save_every=2", "train.batch_size=2", "train.grad_accum=1"]
    torchrun(2, ["sft", str(config_file), f"out={two}", f"dist.strategy={strategy}", *steps])
    checkpoint = two / "checkpoints" / "step-2"
    assert (checkpoint / "COMMITTED").is_file()
    if strategy == "fsdp2":
        assert (checkpoint / "shards" / ".metadata").is_file()
        assert len(list((checkpoint / "shards").glob("*.distcp"))) == 2  # one file of shards per rank
    else:
        assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.safetensors").is_file()
    expected = read_metrics(two)
    assert [r["step"] for r in expected] == [1, 2, 3, 4]

    resumed = [
        train_sft(
            load_config(
                SFTConfig, config_file, overrides=[f"out={tmp_path / 'plain-one'}", f"resume={checkpoint}", *steps]
            )
        )
    ]
    if strategy == "fsdp2":
        resumed.append(tmp_path / "fsdp2-one")
        torchrun(
            1, ["sft", str(config_file), f"out={resumed[-1]}", "dist.strategy=fsdp2", f"resume={checkpoint}", *steps]
        )
    for run in resumed:
        # From the same weights and moments: steps 3 and 4 as two fresh steps of the 2 ranks.
        assert_same_steps(read_metrics(run), expected[2:], lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])
        assert_same_weights(final_weights(run), final_weights(two), lr=LR, eps=EQUIVALENCE_EPS, updates=2)

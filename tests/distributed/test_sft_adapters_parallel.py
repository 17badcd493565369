"""SFT with LoRA, QLoRA and QAT under FSDP2 (gloo): 2 torchrun processes against 1 on the same global batch.

fully_shard shards every Parameter of a layer group, frozen or not: the LoRA adapters (trainable) beside the
frozen base weights, QAT's float weights under fake quantization. A quantized base (QLoRA) is buffers, which
every rank keeps whole. The final directory is gathered into a copy of the model's own structure on rank 0,
so it is the PEFT adapter (LoRA, QLoRA) or the quantized export (QAT) a single process writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.peft.peft_format import ADAPTER_WEIGHTS
from posttrain.trainers.sft import SFTConfig, train_sft
from tests.data.tiny import save_tiny_model_dir, write_qa_jsonl
from tests.distributed.launch import losses, max_difference, torchrun

TOLERANCE = 1e-5
LORA = ["lora.r=4", "lora.alpha=8"]
# Two steps: B starts at zero, so the first step moves B alone and the second also moves A.
STEPS = ["train.batch_size=4", "train.grad_accum=2", "train.max_steps=2", "optim.lr=1e-2", "train.progress=false"]
VARIANTS = {"lora": LORA, "qlora": [*LORA, "quant=int8"], "qat": ["qat=int8"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("sft-adapters-dist")
    model, data = save_tiny_model_dir(root / "model"), write_qa_jsonl(root / "qa.jsonl")
    return [f"model.name_or_path={model}", f"data.path={data}", "data.columns.prompt=question",
            "data.columns.completion=answer", "data.as_chat=true", *STEPS]


def _final_tensors(run: Path) -> dict:
    """What final/ holds of the trained model: the adapter's tensors, or the (quantized) weights."""
    final = run / "final"
    return load_file(str(final / ADAPTER_WEIGHTS if (final / ADAPTER_WEIGHTS).exists() else final / "model.safetensors"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_fsdp2_processes_train_the_adapters_of_one(variant, setup, tmp_path):
    args = [*setup, *VARIANTS[variant]]
    one = train_sft(load_config(SFTConfig, None, [*args, f"out={tmp_path / 'one'}"]))
    two = tmp_path / "two"
    torchrun(2, ["sft", *args, f"out={two}", "dist.strategy=fsdp2"])
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in got] == [1, 2]
    for mine, theirs in zip(got, want):
        assert abs(mine["loss"] - theirs["loss"]) <= TOLERANCE, (variant, mine["step"])
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= TOLERANCE * theirs["grad_norm"], (variant, mine["step"])
    mine, theirs = _final_tensors(two), _final_tensors(one)
    if variant != "qat":
        assert sorted(mine) == sorted(theirs) and all(".lora_" in key for key in theirs)  # the adapter alone
        assert max(float(t.abs().max()) for k, t in theirs.items() if "lora_B" in k) > 1e-3  # B moved from zero
    else:
        assert any(t.dtype.is_floating_point is False for t in theirs.values())  # the int8 export, not floats
    assert max_difference(mine, theirs) <= TOLERANCE


def test_fsdp2_lora_run_resumes_on_one_process(setup, tmp_path):
    """3 steps of QLoRA on 2 FSDP2 ranks, a checkpoint (DCP shards: adapters, frozen base, AdamW moments) at
    step 2; 1 plain process resumed from it takes step 3 as the 2 ranks did, and writes the same adapter."""
    args = [*setup, *VARIANTS["qlora"], "train.max_steps=3", "train.save_every=2", "train.grad_accum=1"]
    two = tmp_path / "two"
    torchrun(2, ["sft", *args, f"out={two}", "dist.strategy=fsdp2"])
    checkpoint = two / "checkpoints" / "step-2"
    assert (checkpoint / "shards" / ".metadata").is_file()
    one = train_sft(load_config(SFTConfig, None, [*args, f"out={tmp_path / 'one'}", f"resume={checkpoint}"]))
    assert sorted(losses(one)) == [3]
    assert abs(losses(one)[3] - losses(two)[3]) <= TOLERANCE
    assert max_difference(_final_tensors(one), _final_tensors(two)) <= TOLERANCE

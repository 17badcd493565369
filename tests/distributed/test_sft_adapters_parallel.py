"""SFT with LoRA, QLoRA and QAT under FSDP2 (gloo): 2 torchrun processes against 1 on the same global batch.

fully_shard shards every Parameter of a layer group, frozen or not: the LoRA adapters (trainable) beside the
frozen base weights, QAT's float weights under fake quantization. A quantized base (QLoRA) is buffers, which
every rank keeps whole. The final directory is gathered into a copy of the model's own structure on rank 0,
so it is the PEFT adapter (LoRA, QLoRA) or the quantized export (QAT) a single process writes.

QLoRA's base runs the fp32 reference kernel in both runs (tests/distributed/fp32_quant.py says why). QAT takes
one step: its forward rounds the weights to the int8 grid, and a later step's weights, which the runs hold up to
AdamW's drift apart, may round to neighbouring codes (a jump of a whole code step, no longer a drift).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.peft.peft_format import ADAPTER_WEIGHTS
from posttrain.trainers.sft import SFTConfig, train_sft
from tests.data.tiny import save_tiny_model_dir, write_qa_jsonl
from tests.distributed import fp32_quant
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import torchrun
from tests.numeric import EQUIVALENCE_EPS, adam_drift

LR = 1e-2
LORA = ["lora.r=4", "lora.alpha=8"]
# optim.eps: AdamW's gain on the rounding 2 processes change (tests/numeric.py).
STEPS = [
    "train.batch_size=4",
    "train.grad_accum=2",
    f"optim.lr={LR}",
    f"optim.eps={EQUIVALENCE_EPS}",
    "train.progress=false",
]
# variant -> (overrides, steps). LoRA: two steps, B starts at zero, so the first moves B alone and the second A too.
VARIANTS = {"lora": (LORA, 2), "qlora": ([*LORA, "quant=int8"], 2), "qat": (["qat=int8"], 1)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("sft-adapters-dist")
    model, data = save_tiny_model_dir(root / "model"), write_qa_jsonl(root / "qa.jsonl")
    return [
        f"model.name_or_path={model}",
        f"data.path={data}",
        "data.columns.prompt=question",
        "data.columns.completion=answer",
        "data.as_chat=true",
        *STEPS,
    ]


def _final_tensors(run: Path) -> dict:
    """What final/ holds of the trained model: the adapter's tensors, or the (quantized) weights."""
    final = run / "final"
    return load_file(
        str(final / ADAPTER_WEIGHTS if (final / ADAPTER_WEIGHTS).exists() else final / "model.safetensors")
    )


def _train_one(args: list[str]) -> Path:
    quantized = any(a.startswith("quant=") for a in args)
    with fp32_quant.reference_kernel() if quantized else contextlib.nullcontext():
        return train_sft(load_config(SFTConfig, None, args))


def _train_two(args: list[str]) -> None:
    quantized = any(a.startswith("quant=") for a in args)
    torchrun(2, ["sft", *args, "dist.strategy=fsdp2"], module=fp32_quant.__name__ if quantized else "posttrain")


def _assert_same_export(got: dict, want: dict, drift: float) -> None:
    """QAT's int8 exports of float weights up to `drift` apart: scales (absmax / 127) within drift / 127, the codes
    of each weight rounded from values that close: equal or, where one sat by a rounding boundary, one apart."""
    assert sorted(got) == sorted(want)
    for name, theirs in want.items():
        mine = got[name]
        if theirs.dtype.is_floating_point:
            bound = drift / 127 if name.endswith(".scales") else drift
            assert float((mine - theirs).abs().max()) <= bound, name
        else:
            assert drift < 0.5 * float(want[name.removesuffix("qweight") + "scales"].abs().min())  # < half a code step
            assert int((mine.int() - theirs.int()).abs().max()) <= 1, name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_fsdp2_processes_train_the_adapters_of_one(variant, setup, tmp_path):
    overrides, steps = VARIANTS[variant]
    args = [*setup, *overrides, f"train.max_steps={steps}"]
    one = _train_one([*args, f"out={tmp_path / 'one'}"])
    two = tmp_path / "two"
    _train_two([*args, f"out={two}"])
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])
    mine, theirs = _final_tensors(two), _final_tensors(one)
    if variant != "qat":
        assert sorted(mine) == sorted(theirs) and all(".lora_" in key for key in theirs)  # the adapter alone
        assert max(float(t.abs().max()) for k, t in theirs.items() if "lora_B" in k) > 1e-3  # B moved from zero
        assert_same_weights(mine, theirs, lr=LR, eps=EQUIVALENCE_EPS, updates=steps)
    else:
        assert any(t.dtype.is_floating_point is False for t in theirs.values())  # the int8 export, not floats
        _assert_same_export(mine, theirs, adam_drift(LR, steps, EQUIVALENCE_EPS))


def test_fsdp2_lora_run_resumes_on_one_process(setup, tmp_path):
    """3 steps of QLoRA on 2 FSDP2 ranks, a checkpoint (DCP shards: adapters, frozen base, AdamW moments) at
    step 2; 1 plain process resumed from it takes step 3 as the 2 ranks did, and writes the same adapter."""
    args = [*setup, *VARIANTS["qlora"][0], "train.max_steps=3", "train.save_every=2", "train.grad_accum=1"]
    two = tmp_path / "two"
    _train_two([*args, f"out={two}"])
    checkpoint = two / "checkpoints" / "step-2"
    assert (checkpoint / "shards" / ".metadata").is_file()
    one = _train_one([*args, f"out={tmp_path / 'one'}", f"resume={checkpoint}"])
    # From the same weights and moments: step 3 as one fresh step of the 2 ranks.
    assert_same_steps(read_metrics(one), read_metrics(two)[2:], lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm"])
    assert_same_weights(_final_tensors(one), _final_tensors(two), lr=LR, eps=EQUIVALENCE_EPS, updates=1)

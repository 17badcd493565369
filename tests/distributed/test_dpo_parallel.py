"""DPO and paired KTO data-parallel on CPU (gloo): 2 torchrun processes against 1 on the same global batch
of pairs.

KTO's KL reference point z0 is a mean over the micro-batch's mismatched rows; each rank gathers the other
ranks' KL logps so it clamps the same z0 as one process. z0 is 0 while the policy equals the reference, so
the KTO run takes 2 steps: the second has a moved policy and a non-zero z0. KTO on an unpaired file (fixed
batches of labelled rows) is held to the same: its z0 is gathered over each fixed batch's KL rows.

With LoRA under FSDP2 the reference is the policy's own base (adapters off): precomputed before sharding, or
live, through the FSDP2 wrapper (the base weights are whole only inside its hooks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors
from posttrain.peft.peft_format import ADAPTER_WEIGHTS
from posttrain.trainers.dpo import DPOConfig, train_dpo
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.numeric import EQUIVALENCE_EPS, reorder_close
from tests.trainers.pref_helpers import config, setup_dir, write_jsonl
from tests.trainers.test_kto_unpaired import unpaired_rows

LR = 1e-2
# A global batch of 4 pairs x 2 accumulation steps; each rank takes 2 pairs of every micro-batch. optim.eps: AdamW's
# gain on the gradients' rounding, which the split over 2 processes changes (tests/numeric.py).
BATCH = [
    "train.batch_size=4",
    "train.grad_accum=2",
    f"optim.lr={LR}",
    f"optim.eps={EQUIVALENCE_EPS}",
    "optim.warmup_ratio=0",
    "data.eval_fraction=0",
    "beta=0.5",
]
DPO_STEP = [*BATCH, "train.max_steps=1"]
KTO_STEPS = [*BATCH, "loss=kto", "train.max_steps=2"]
# LoRA's B starts at zero: the first step moves B alone, the second A too, by a gradient proportional to B.
LORA_STEPS = [*BATCH, "lora.r=4", "lora.alpha=8", "train.max_steps=2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return setup_dir(tmp_path_factory.mktemp("dpo-dist"))


def _one_process(data: tuple[Path, Path], out: Path, args: list[str]) -> Path:
    model, pairs = data
    return train_dpo(config(DPOConfig, model, pairs, out, *args))


def _two_processes(data: tuple[Path, Path], out: Path, strategy: str, args: list[str]) -> Path:
    model, pairs = data
    torchrun(
        2,
        [
            "dpo",
            f"model.name_or_path={model}",
            f"data.path={pairs}",
            f"out={out}",
            "train.progress=false",
            f"dist.strategy={strategy}",
            *args,
        ],
    )
    return out


@pytest.fixture(scope="module")
def dpo_one(data, tmp_path_factory) -> Path:
    return _one_process(data, tmp_path_factory.mktemp("dpo-one") / "run", DPO_STEP)


@pytest.fixture(scope="module")
def kto_one(data, tmp_path_factory) -> Path:
    return _one_process(data, tmp_path_factory.mktemp("kto-one") / "run", KTO_STEPS)


@pytest.fixture(scope="module")
def unpaired(data, tmp_path_factory) -> tuple[Path, Path]:
    """(model dir, 16 unpaired rows of both labels): 4 fixed batches of 4 rows, 2 of each on every rank."""
    return data[0], write_jsonl(tmp_path_factory.mktemp("kto-unpaired") / "unpaired.jsonl", unpaired_rows())


@pytest.fixture(scope="module")
def unpaired_one(unpaired, tmp_path_factory) -> Path:
    return _one_process(unpaired, tmp_path_factory.mktemp("unpaired-one") / "run", KTO_STEPS)


def _same_kto_steps(two: Path, one: Path, count: str) -> None:
    """2 KTO steps of `two` processes equal those of `one`, z0 in play; `count`: the step's pairs or rows."""
    got, want = read_metrics(two), read_metrics(one)
    assert len(got) == len(want) == 2
    assert max(record["kl"] for record in want) > 1e-4  # z0 is in play (step 2), so a per-rank z0 would show
    for g, w in zip(got, want):
        assert g[count] == w[count] == 8 and g["tokens"] == w["tokens"]
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["kl", "grad_norm", "rewards/chosen"])
    assert_same_weights(final_weights(two), final_weights(one), lr=LR, eps=EQUIVALENCE_EPS, updates=2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_dpo_step_of_one(strategy, data, dpo_one, tmp_path):
    out = _two_processes(data, tmp_path / "run", strategy, DPO_STEP)
    got, want = read_metrics(out), read_metrics(dpo_one)
    assert got[0]["pairs"] == want[0]["pairs"] == 8 and got[0]["tokens"] == want[0]["tokens"]
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm", "rewards/margins", "nll/chosen"])
    reference = final_weights(dpo_one)
    assert max_difference(read_safetensors(data[0]), reference) > 1e-3  # the step moved the weights
    assert_same_weights(final_weights(out), reference, lr=LR, eps=EQUIVALENCE_EPS, updates=1)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_kto_steps_of_one(strategy, data, kto_one, tmp_path):
    _same_kto_steps(_two_processes(data, tmp_path / "run", strategy, KTO_STEPS), kto_one, "pairs")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_unpaired_kto_steps_of_one(strategy, unpaired, unpaired_one, tmp_path):
    _same_kto_steps(_two_processes(unpaired, tmp_path / "run", strategy, KTO_STEPS), unpaired_one, "rows")


@pytest.mark.parametrize("reference", ["precompute", "live"])
def test_two_fsdp2_processes_take_the_lora_dpo_steps_of_one(reference, data, tmp_path):
    # 2 held-out pairs, scored before training: the no-grad pass leaves the sharded weights resharded, so a
    # live reference outside the wrapper would meet shards there.
    args = [*LORA_STEPS, f"reference={reference}", "data.eval_fraction=0.25"]
    one = _one_process(data, tmp_path / "one", args)
    two = _two_processes(data, tmp_path / "two", "fsdp2", args)
    got, want = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2]
    assert reorder_close(got[0]["eval_loss"], want[0]["eval_loss"])  # before any update
    assert_same_steps(got[1:], want[1:], lr=LR, eps=EQUIVALENCE_EPS, compared=["grad_norm", "rewards/margins"])
    assert want[2]["rewards/margins"] != 0  # the second step's policy differs from the reference: it is in play
    adapters = [load_file(str(run / "final" / ADAPTER_WEIGHTS)) for run in (one, two)]
    assert_same_weights(*adapters, lr=LR, eps=EQUIVALENCE_EPS, updates=2)

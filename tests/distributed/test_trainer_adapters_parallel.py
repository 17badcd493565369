"""GRPO, PPO, reward models and distillation with LoRA and QLoRA under FSDP2 (gloo): 2 torchrun processes against
1 on the same data, as tests/distributed/test_sft_adapters_parallel.py does for SFT.

The RL trainers and on-policy distillation sample with the rollout engine over the live model, whose LoRA linears
the engine calls unmerged: on whole gathered weights (`dist.rollout_weights=whole`) or one layer at a time
(`per_layer`), both covered below. GRPO's KL reference is the policy with its adapters off, run through the FSDP2
wrapper. Two steps each: LoRA's B starts at zero, so the first step moves B alone and the second A too.
`final/` must hold the adapter (and the score / value head) one process writes. The 2-rank run also checkpoints
step 1 (DCP shards: adapters, frozen base, optimizer moments, RNG streams), and one plain process resumed from it
takes step 2 as the 2 ranks did and writes the same final files."""

from __future__ import annotations

import contextlib

import pytest

from posttrain.metrics import read_metrics
from posttrain.peft.peft_format import ADAPTER_WEIGHTS
from tests.data.tiny import save_tiny_model_dir
from tests.distributed import fp32_quant
from tests.distributed.equivalence import assert_same_steps, assert_same_weights
from tests.distributed.launch import final_adapter_config, final_files, one_process, torchrun
from tests.distributed.rl_setup import LR, rl_overrides
from tests.numeric import EQUIVALENCE_EPS
from tests.trainers.pref_helpers import setup_dir

LORA = ["lora.r=4", "lora.alpha=8"]
QLORA = [*LORA, "quant=int8"]
# Reward models and distillation: 4 pairs (rows) a step in 2 micro-batches, 2 steps, AdamW as the RL tests have it
# (tests/distributed/rl_setup.py; eps: tests/numeric.py).
PAIR_STEPS = [
    "train.batch_size=4",
    "train.grad_accum=2",
    "train.max_steps=2",
    f"optim.lr={LR}",
    f"optim.eps={EQUIVALENCE_EPS}",
    "data.eval_fraction=0",
    "train.progress=false",
]
GRPO = ["rollout.samples_per_prompt=4", "train.micro_batch_size=4", "kl.beta=0.1"]  # kl: the adapters-off base
# 8 samples a step in 2 minibatches: 2 updates a step. The value head at the policy's rate, not its default 100x:
# at lr 1 AdamW's gain of 2 lr / eps on the head's rounding moves the next rollout's values, and with them the
# advantages of the whole update.
PPO = ["rollout.samples_per_prompt=2", "train.epochs=1", "train.minibatch_size=4", f"ppo.value_lr={LR}"]
UPDATES_PER_STEP = {"ppo": 2}
DISTILL = ["mode=on_policy", "seed_prompts=true", "max_new_tokens=6", "loss=jsd"]
# Metrics of the sampled completions: the same tokens at every step (tests/distributed/equivalence.py).
SAMPLED = {"reward/mean", "loss_tokens"}

# case -> (command, setup, overrides, the 2 ranks' dist.rollout_weights, metrics compared besides loss and grad_norm)
CASES: dict[str, tuple[str, str, list[str], str, tuple[str, ...]]] = {
    "grpo-lora": ("grpo", "rl", [*GRPO, *LORA], "whole", ("reward/mean",)),
    "grpo-qlora-per_layer": ("grpo", "rl", [*GRPO, *QLORA], "per_layer", ("reward/mean",)),
    "ppo-lora-per_layer": ("ppo", "rl", [*PPO, *LORA], "per_layer", ("reward/mean",)),
    "ppo-qlora": ("ppo", "rl", [*PPO, *QLORA], "whole", ("reward/mean",)),
    "rm-lora": ("rm", "pairs", LORA, "whole", ("accuracy", "margin")),
    "rm-qlora": ("rm", "pairs", QLORA, "whole", ("accuracy", "margin")),
    "distill-lora-per_layer": ("distill", "distill", [*DISTILL, *LORA], "per_layer", ("loss_tokens",)),
    "distill-qlora": ("distill", "distill", [*DISTILL, *QLORA], "whole", ("loss_tokens",)),
}


@pytest.fixture(scope="module")
def setups(tmp_path_factory) -> dict[str, list[str]]:
    """Each kind of run's model and data as overrides (the RL ones: tests/distributed/rl_setup.py)."""
    root = tmp_path_factory.mktemp("adapters-dist")
    model, pairs = setup_dir(root / "pref")
    teacher = save_tiny_model_dir(root / "teacher", seed=1)
    (root / "rl").mkdir()
    on_pairs = [f"model.name_or_path={model}", f"data.path={pairs}", *PAIR_STEPS]
    return {
        "rl": rl_overrides(root / "rl"),
        "pairs": on_pairs,
        "distill": [*on_pairs, f"teacher.name_or_path={teacher}"],
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_fsdp2_processes_train_the_adapters_of_one(case, setups, tmp_path):
    command, setup, overrides, rollout_weights, compared = CASES[case]
    args = [command, *setups[setup], *overrides]
    # QLoRA's base in fp32 (the reference kernel), in both runs: tests/distributed/fp32_quant.py says why.
    quantized = any(o.startswith("quant=") for o in overrides)
    in_fp32 = fp32_quant.reference_kernel if quantized else contextlib.nullcontext
    module = fp32_quant.__name__ if quantized else "posttrain"
    with in_fp32():
        one_process([*args, f"out={tmp_path / 'one'}"])
    torchrun(
        2,
        [
            *args,
            f"out={tmp_path / 'two'}",
            "dist.strategy=fsdp2",
            f"dist.rollout_weights={rollout_weights}",
            "train.save_every=1",
        ],
        module=module,
    )
    got, want = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    updates = UPDATES_PER_STEP.get(command, 1)
    metrics = {
        "compared": ["grad_norm", *(k for k in compared if k not in SAMPLED)],
        "sampled": [k for k in compared if k in SAMPLED],
        "updates_per_step": updates,
    }
    assert_same_steps(got, want, lr=LR, eps=EQUIVALENCE_EPS, **metrics)
    mine, theirs = final_files(tmp_path / "two"), final_files(tmp_path / "one")
    assert sorted(mine) == sorted(theirs) and ADAPTER_WEIGHTS in theirs  # + score / value head
    adapter = theirs[ADAPTER_WEIGHTS]
    assert max(float(t.abs().max()) for k, t in adapter.items() if "lora_B" in k) > 1e-3  # B moved from zero
    for name in theirs:
        assert_same_weights(mine[name], theirs[name], lr=LR, eps=EQUIVALENCE_EPS, updates=2 * updates)
    assert final_adapter_config(tmp_path / "two") == final_adapter_config(tmp_path / "one")
    checkpoint = tmp_path / "two" / "checkpoints" / "step-1"
    assert (checkpoint / "shards" / ".metadata").is_file()
    with in_fp32():
        one_process([*args, f"out={tmp_path / 'resumed'}", f"resume={checkpoint}"])
    again = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in again] == [2]
    # From the same weights and moments: step 2 as one fresh step of the 2 ranks.
    assert_same_steps(again, got[1:], lr=LR, eps=EQUIVALENCE_EPS, **metrics)
    resumed = final_files(tmp_path / "resumed")
    for name in mine:
        assert_same_weights(resumed[name], mine[name], lr=LR, eps=EQUIVALENCE_EPS, updates=updates)

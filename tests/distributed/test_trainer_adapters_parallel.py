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

from pathlib import Path

import pytest

from posttrain.metrics import read_metrics
from posttrain.peft.peft_format import ADAPTER_WEIGHTS
from tests.data.tiny import save_tiny_model_dir
from tests.distributed.launch import final_adapter_config, final_files, max_difference, one_process, torchrun
from tests.distributed.rl_setup import rl_overrides
from tests.trainers.pref_helpers import setup_dir

TOLERANCE = 1e-5
LORA = ["lora.r=4", "lora.alpha=8"]
QLORA = [*LORA, "quant=int8"]
# Reward models and distillation: 4 pairs (rows) a step in 2 micro-batches, 2 steps. optim.eps=1e-3, the RL
# tests' (tests/distributed/rl_setup.py): at step 2 A's gradient is proportional to the once-moved B, small enough
# that with eps=1e-4 AdamW's step lr * g / (|g| + eps) still follows the rounding 2 processes change (QLoRA's
# reward model was 5e-5 off in its loss); 1e-3 keeps the comparison about the gradients themselves.
PAIR_STEPS = ["train.batch_size=4", "train.grad_accum=2", "train.max_steps=2", "optim.lr=1e-2", "optim.eps=1e-3",
              "data.eval_fraction=0", "train.progress=false"]
GRPO = ["rollout.samples_per_prompt=4", "train.micro_batch_size=4", "kl.beta=0.1"]  # kl: the adapters-off base
PPO = ["rollout.samples_per_prompt=2", "train.epochs=1", "train.minibatch_size=4"]
DISTILL = ["mode=on_policy", "seed_prompts=true", "max_new_tokens=6", "loss=jsd"]

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
    return {"rl": rl_overrides(root / "rl"), "pairs": on_pairs,
            "distill": [*on_pairs, f"teacher.name_or_path={teacher}"]}


def _close(got: dict, want: dict, key: str) -> bool:
    return abs(got[key] - want[key]) <= TOLERANCE * max(1.0, abs(want[key]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_fsdp2_processes_train_the_adapters_of_one(case, setups, tmp_path):
    command, setup, overrides, rollout_weights, compared = CASES[case]
    args = [command, *setups[setup], *overrides]
    one_process([*args, f"out={tmp_path / 'one'}"])
    torchrun(2, [*args, f"out={tmp_path / 'two'}", "dist.strategy=fsdp2", f"dist.rollout_weights={rollout_weights}",
                 "train.save_every=1"])
    got, want = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for mine, theirs in zip(got, want):
        for key in ("loss", "grad_norm", *compared):
            assert _close(mine, theirs, key), (mine["step"], key, mine[key], theirs[key])
    mine, theirs = final_files(tmp_path / "two"), final_files(tmp_path / "one")
    assert sorted(mine) == sorted(theirs) and ADAPTER_WEIGHTS in theirs  # + score / value head
    adapter = theirs[ADAPTER_WEIGHTS]
    assert max(float(t.abs().max()) for k, t in adapter.items() if "lora_B" in k) > 1e-3  # B moved from zero
    for name in theirs:
        assert max_difference(mine[name], theirs[name]) <= TOLERANCE, name
    assert final_adapter_config(tmp_path / "two") == final_adapter_config(tmp_path / "one")
    checkpoint = tmp_path / "two" / "checkpoints" / "step-1"
    assert (checkpoint / "shards" / ".metadata").is_file()
    one_process([*args, f"out={tmp_path / 'resumed'}", f"resume={checkpoint}"])
    [again] = read_metrics(tmp_path / "resumed")
    assert again["step"] == 2
    for key in ("loss", "grad_norm", *compared):
        assert _close(again, got[1], key), ("resumed", key, again[key], got[1][key])
    resumed = final_files(tmp_path / "resumed")
    for name in mine:
        assert max_difference(resumed[name], mine[name]) <= TOLERANCE, ("resumed", name)

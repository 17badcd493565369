"""GRPO data-parallel on CPU (gloo): 2 torchrun processes against 1 over the same prompts.

Exactness comes from `rollout.seed_prompts`: each prompt's request is seeded from (train.seed, step, its place
among the step's prompts), so the rank that gets it samples the very completions the single process does;
the rest (group advantages, the globally-normalised token-mean loss, the gradient reduction) is then exact.
Two steps: the second samples from the weights the first update wrote (gathered whole under FSDP2). The FSDP2
run also checkpoints step 1 (DCP shards), which one plain process resumes into the same step 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import read_safetensors, save_hf_dir
from posttrain.trainers.rl import train_grpo
from posttrain.trainers.rl_config import GRPOConfig
from tests.distributed.launch import final_weights, max_difference, torchrun
from tests.trainers.rl_helpers import reward_file, tiny_model, tokenizer

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def overrides(tmp_path_factory) -> list[str]:
    """4 prompts x 4 samples a step, micro-batches of one group (each rank accumulates 2 of them), a KL term
    against a frozen reference copy, and a reward with spread inside every group.

    optim.eps=1e-3: AdamW's first step is lr * g / (|g| + eps). Over this 49152-token tied vocabulary most
    rows of the LM head get gradients at rounding level (~1e-10, rare tokens' probabilities); with eps=1e-8
    each would take a near-full step whose size is set by the rounding of the summation order, which two
    processes change. A larger eps keeps the comparison about the gradients themselves."""
    root = tmp_path_factory.mktemp("grpo-dist")
    tok = tokenizer()
    model = save_hf_dir(tiny_model(tok), root / "model", tokenizer=tok)
    return [f"model.name_or_path={model}", f"reward.functions=[{reward_file(root)}:char_mix]",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_tokens=6",
            "rollout.seed_prompts=true", "train.micro_batch_size=4", "train.max_steps=2", "kl.beta=0.1",
            "optim.lr=1e-2", "optim.eps=1e-3", "data.eval_size=0", "log.progress=false"]


@pytest.fixture(scope="module")
def one_process(overrides, tmp_path_factory) -> Path:
    return train_grpo(load_config(GRPOConfig, None, [*overrides, f"out={tmp_path_factory.mktemp('one') / 'run'}"]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_take_the_grpo_steps_of_one(strategy, overrides, one_process, tmp_path):
    out = tmp_path / "run"
    save = ["train.save_every=1"] if strategy == "fsdp2" else []  # a sharded checkpoint at step 1, resumed below
    torchrun(2, ["grpo", *overrides, f"out={out}", f"dist.strategy={strategy}", *save])
    got, want = read_metrics(out), read_metrics(one_process)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for mine, theirs in zip(got, want):
        assert mine["num_samples"] == theirs["num_samples"] == 16
        # The same completions (same rewards, lengths) and the same update (loss, gradient norm). Means over
        # the samples are exact (equal shares); spreads such as reward/std are the ranks' averaged, not compared.
        for key in ("reward/mean", "response_len/mean", "loss", "grad_norm"):
            assert abs(mine[key] - theirs[key]) <= TOLERANCE * max(1.0, abs(theirs[key])), (mine["step"], key)
    reference = final_weights(one_process)
    model_dir = Path(next(o for o in overrides if o.startswith("model.")).split("=", 1)[1])
    assert max_difference(read_safetensors(model_dir), reference) > 1e-3  # the steps moved the weights
    assert max_difference(final_weights(out), reference) <= TOLERANCE
    if strategy == "fsdp2":
        # The 2-rank sharded checkpoint, resumed by one plain process: step 2 samples and updates as before.
        resumed = train_grpo(load_config(GRPOConfig, None, [*overrides, f"out={tmp_path / 'resumed'}",
                                                            f"resume={out / 'checkpoints' / 'step-1'}"]))
        [again] = read_metrics(resumed)
        for key in ("reward/mean", "loss", "grad_norm"):
            assert abs(again[key] - got[1][key]) <= TOLERANCE * max(1.0, abs(got[1][key])), key
        assert max_difference(final_weights(resumed), final_weights(out)) <= TOLERANCE

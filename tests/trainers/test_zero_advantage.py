"""Zero-advantage groups leave the update's forward, and the update does not notice: same weights,
same optimizer steps, with the skip on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.trainers.packed_groups import pack_groups, packed_forward
from posttrain.trainers.rl import rl_step, setup_run
from posttrain.trainers.rl.config import GRPOConfig
from posttrain.trainers.rl.zero_advantage import trained_packs, zero_advantage_is_free
from tests.numeric import assert_reordered
from tests.trainers.rl_helpers import reward_file, tiny_model, tokenizer


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _groups(num_groups: int, G: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (3 + g,), generator=gen).tolist() for g in range(num_groups)]
    completions = [
        [torch.randint(3, 200, (1 + (g + j) % 4,), generator=gen).tolist() for j in range(G)] for g in range(num_groups)
    ]
    return prompts, completions


def test_trained_packs_drop_dead_groups_and_keep_rows_aligned(tok) -> None:
    G = 3
    prompts, completions = _groups(6, G)
    # groups 0..5, two per micro-batch: [live, dead] [dead, dead] [live, live]
    adv = torch.tensor([1.0, -1.0, 0.0] + [0.0] * G * 3 + [0.5, 0.0, -0.5] + [0.0, 2.0, -2.0])
    packs = [pack_groups(prompts[g : g + 2], completions[g : g + 2]) for g in (0, 2, 4)]
    slices = [slice(g * G, (g + 2) * G) for g in (0, 2, 4)]
    plan = trained_packs(packs, slices, adv, G, keep_one=False)
    assert [p.skipped_groups for p in plan] == [1, 2, 0]
    assert plan[1].pack is None
    assert plan[2].pack is packs[2] and plan[2].rows == slices[2]
    assert plan[0].rows.tolist() == [0, 1, 2]
    # The trimmed pack computes exactly the rows it names.
    model = tiny_model(tok)
    with torch.no_grad():
        full = packed_forward(model, packs[0], 1.0).logprobs  # (2G, L)
        trimmed = packed_forward(model, plan[0].pack, 1.0).logprobs  # (G, L')
    L = trimmed.shape[1]
    # Fewer rows and a shorter pack: the same logprobs up to the sums' order (tests/numeric.py).
    assert_reordered(trimmed, full[plan[0].rows.tolist(), :L])
    # Under torchrun no micro-batch goes empty: it keeps its first group.
    kept = trained_packs(packs, slices, adv, G, keep_one=True)
    assert kept[1].pack is not None and kept[1].rows.tolist() == [6, 7, 8] and kept[1].skipped_groups == 1


def test_only_a_loss_without_other_terms_skips() -> None:
    outcome, token_level = torch.zeros(4), torch.zeros(4, 3)
    assert zero_advantage_is_free(outcome, kl_loss=False, entropy_coef=0.0, value_head=False, router_loss=False)
    assert not zero_advantage_is_free(token_level, kl_loss=False, entropy_coef=0.0, value_head=False, router_loss=False)
    for blocker in ({"kl_loss": True}, {"entropy_coef": 0.01}, {"value_head": True}, {"router_loss": True}):
        flags = {"kl_loss": False, "entropy_coef": 0.0, "value_head": False, "router_loss": False, **blocker}
        assert not zero_advantage_is_free(outcome, **flags), blocker


def _run(tmp_path: Path, tok, name: str, *extra: str):
    overrides = [
        f"out={tmp_path / name}",
        f"reward.functions=[{reward_file(tmp_path)}:parity_gated]",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_tokens=6",
        "data.eval_size=0",
        "log.progress=false",
        "optim.lr=1e-2",
        "dapo.dynamic_sampling=false",
        *extra,
    ]
    cfg = load_config(GRPOConfig, None, overrides)
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    metrics = [rl_step(run, step) for step in (1, 2)]
    return run, metrics


LOSS_TOL = 1e-6  # logged losses with and without the skip: float32 sums of terms ~1 in another order


@pytest.mark.parametrize(
    "algorithm, batching",
    [
        ("grpo", ["train.micro_batch_size=4"]),  # one group per micro-batch, one optimizer step
        ("dr_grpo", ["train.minibatch_size=4", "train.epochs=2"]),  # whole minibatches of dead groups
        ("gspo", ["train.epochs=2"]),  # one micro-batch, trimmed of its dead groups
    ],
)
def test_skipping_changes_nothing_but_the_work(tmp_path: Path, tok, algorithm: str, batching: list[str]) -> None:
    """parity_gated scores every odd-answer group 0.0 across the board: those groups are dead.

    With a single update the ratio is 1 and equal-length samples give a policy loss of ~0, which no
    inflation of the logged value could show; a second epoch moves the ratio off 1."""
    extra = [f"algorithm={algorithm}", *batching]
    skip, skip_metrics = _run(tmp_path, tok, "skip", *extra)
    full, full_metrics = _run(tmp_path, tok, "full", *extra, "train.skip_zero_advantage=false")
    assert any(m["update/skipped_group_frac"] > 0 for m in skip_metrics)
    assert all(m["update/skipped_group_frac"] == 0 for m in full_metrics)
    assert all(m["zero_variance_frac"] < 1 for m in skip_metrics), "some group must train"
    for a, b in zip(skip_metrics, full_metrics):
        assert a["optimizer_steps"] == b["optimizer_steps"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-7)
        # Every logged loss (the minibatch loss and its parts): a skipped group's loss is exactly 0, so the
        # logged values are those of the full pass, up to summation order (float32 sums of terms ~1: 1e-6).
        losses = sorted(k for k in b if k == "loss" or k.startswith("loss/"))
        assert "loss/policy" in losses and losses == sorted(k for k in a if k == "loss" or k.startswith("loss/"))
        for key in losses:
            assert a[key] == pytest.approx(b[key], abs=LOSS_TOL), (key, a[key], b[key])
    if "train.epochs=2" in batching:
        # The comparison has teeth: a loss ten times its tolerance, so the inflation it guards against (a skipped
        # micro-batch doubling the logged value) is off by at least that loss. The size itself depends on the CPU's
        # rounding of a ratio near 1 (GSPO's clip range is 3e-4: 9.8e-5 on an AVX2 EPYC, above 1e-4 on a Zen 5).
        assert max(abs(m["loss/policy"]) for m in full_metrics) > 10 * LOSS_TOL
    for p, q in zip(skip.model.parameters(), full.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_kl_loss_keeps_every_group(tmp_path: Path, tok) -> None:
    _, metrics = _run(tmp_path, tok, "kl", "kl.beta=0.05")
    assert all(m["update/skipped_group_frac"] == 0 for m in metrics)

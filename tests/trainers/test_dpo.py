from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posttrain.algos.preference import PREFERENCE_LOSSES
from posttrain.cli import main
from posttrain.config import parse_cli_config
from posttrain.data.collate import Batch
from posttrain.data.preference_pairs import PairRow, load_pairs
from posttrain.data.tokenize import TokenizedRow
from posttrain.data.validate import DataError
from posttrain.errors import ConfigError
from posttrain.models.hub import load_model
from posttrain.trainers.packed_groups import PackedGroups
from posttrain.trainers.preference.dpo import DPOConfig, train_dpo
from posttrain.trainers.preference.logps import (
    by_length,
    collate_pairs,
    frozen_pair_logps,
    packed_length,
    pair_logps,
    shares_prompt,
)
from tests.trainers.pref_helpers import config, read_metrics, setup_dir, write_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return setup_dir(tmp_path_factory.mktemp("dpo"))


@pytest.mark.parametrize("layout", ["packed", "rows"])
def test_policy_logps_match_transformers_forward(tiny, layout):
    """Both layouts of `collate_pairs` against transformers on each row alone: one packed row per pair (the
    prompt once), and 2B padded rows (what a pair whose rows do not share their prompt takes)."""
    transformers = pytest.importorskip("transformers")
    model_dir, data = tiny
    model, tok = load_model(model_dir)
    cfg = config(DPOConfig, model_dir, data, model_dir / "unused")
    pairs = load_pairs(cfg.data, tok, seed=0).train[:3]
    assert all(shares_prompt(p) for p in pairs)
    if layout == "rows":  # a rejected row whose prompt differs in one token: the pair cannot share it
        first = pairs[0]
        ids = list(first.rejected.input_ids)
        ids[0] = (ids[0] + 1) % model.config.vocab_size
        pairs[0] = dataclasses.replace(first, rejected=dataclasses.replace(first.rejected, input_ids=ids))
    batch = collate_pairs(pairs, tok.pad_token_id)
    assert isinstance(batch, PackedGroups if layout == "packed" else Batch)
    with torch.no_grad():
        ours, lengths = pair_logps(model, batch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    for i, row in enumerate(rows):
        ids = torch.tensor([row.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)  # (T-1, V) predicts tokens 1..T-1
        labels = torch.tensor(row.labels[1:])
        mask = labels != -100
        expected = logp[mask].gather(1, labels[mask][:, None]).sum()
        assert int(lengths[i]) == int(mask.sum())
        torch.testing.assert_close(ours[i], expected, rtol=1e-4, atol=1e-4)


def test_a_pass_over_pairs_sorted_by_length_keeps_each_pairs_logps(tiny):
    """The reference table is taken in batches of similar length: each pair's entry is its own logps."""
    model_dir, data = tiny
    model, tok = load_model(model_dir)
    cfg = config(DPOConfig, model_dir, data, model_dir / "unused")
    pairs = load_pairs(cfg.data, tok, seed=0).train[:7]
    lengths = [packed_length(p) for p in pairs]
    assert len(set(lengths)) > 1 and lengths != sorted(lengths)  # the sort reorders something
    chosen, rejected = frozen_pair_logps(model, pairs, 3, tok.pad_token_id)
    for i, pair in enumerate(pairs):
        with torch.no_grad():
            alone = pair_logps(model, collate_pairs([pair], tok.pad_token_id))[0]
        torch.testing.assert_close(torch.stack([chosen[i], rejected[i]]), alone, rtol=1e-5, atol=1e-4)


def test_a_steps_pairs_are_regrouped_by_length_into_the_same_sizes():
    rows = [
        PairRow(TokenizedRow([1] * n, [-100] + [1] * (n - 1)), TokenizedRow([1] * n, [-100] + [1] * (n - 1)))
        for n in (9, 3, 7, 2, 5)
    ]
    assert by_length([[0, 1, 2], [3, 4]], rows) == [[3, 1, 4], [2, 0]]
    assert by_length([[0]], rows) == [[0]]


def test_dpo_steps_raise_training_pairwise_accuracy(tiny, tmp_path):
    model_dir, data = tiny
    cfg = config(
        DPOConfig,
        model_dir,
        data,
        tmp_path / "run",
        "train.max_steps=12",
        "train.batch_size=8",
        "optim.lr=2e-3",
        "optim.warmup_ratio=0",
        "optim.schedule=constant",
        "beta=0.5",
    )
    records = [r for r in read_metrics(train_dpo(cfg)) if "loss" in r]
    assert records[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)  # policy == reference before step 1
    assert records[-1]["rewards/accuracies"] == 1.0
    assert records[-1]["rewards/margins"] > 0 and records[-1]["loss"] < records[0]["loss"]
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "nll/chosen", "nll/rejected"):
        assert math.isfinite(records[-1][key])
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_precomputed_and_live_reference_give_the_same_first_step(tiny, tmp_path):
    model_dir, data = tiny
    firsts = []
    for ref in ("precompute", "live"):
        cfg = config(
            DPOConfig,
            model_dir,
            data,
            tmp_path / ref,
            "train.max_steps=2",
            "train.batch_size=4",
            "optim.lr=1e-3",
            f"reference={ref}",
            "loss=ipo",
        )
        records = [r for r in read_metrics(train_dpo(cfg)) if "loss" in r]
        firsts.append(records)
    for a, b in zip(*firsts):  # step 2 too: live reference stays the initial model
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("loss", sorted(PREFERENCE_LOSSES))
def test_each_loss_runs_a_step_with_held_out_eval(tiny, tmp_path, loss):
    model_dir, data = tiny
    cfg = config(
        DPOConfig,
        model_dir,
        data,
        tmp_path / loss,
        "train.max_steps=1",
        "train.batch_size=3",
        "data.eval_fraction=0.25",
        f"loss={loss}",
        "optim.lr=1e-3",
    )
    records = read_metrics(train_dpo(cfg))
    before, last = records[0], records[-1]
    assert before["step"] == 0 and before["eval_pairs"] == 2
    assert math.isfinite(last["loss"]) and math.isfinite(last["eval_loss"])
    assert 0.0 <= last["eval_reward_accuracy"] <= 1.0
    if loss not in ("simpo", "orpo"):
        assert before["eval_reward_accuracy"] == 0.5  # untrained: all implicit rewards tie at 0


def test_cli_runs_and_unknown_loss_fails_clearly(tiny, tmp_path, capsys):
    model_dir, data = tiny
    assert (
        main(
            [
                "dpo",
                f"model.name_or_path={model_dir}",
                f"data.path={data}",
                f"out={tmp_path / 'cli'}",
                "--train.max_steps",
                "1",
                "--train.progress",
                "false",
                "--loss",
                "hinge",
            ]
        )
        == 0
    )
    assert (tmp_path / "cli" / "final").is_dir()
    with pytest.raises(ConfigError, match=r"loss: unknown loss 'dpoo' \(choose from sigmoid"):
        parse_cli_config(DPOConfig, [f"data.path={data}", "--loss", "dpoo"])
    with pytest.raises(ConfigError, match="gamma: not an option of loss 'sigmoid'"):
        parse_cli_config(DPOConfig, [f"data.path={data}", "gamma=0.5"])


def test_missing_chosen_field_fails_with_file_and_line(tiny, tmp_path):
    model_dir, _ = tiny
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "rejected": " no"}] * 3)
    cfg = config(DPOConfig, model_dir, bad, tmp_path / "run", "data.format=preference", "train.max_steps=1")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing field 'chosen'"):
        train_dpo(cfg)
    sft_rows = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "hi", "completion": " there"}] * 3)
    cfg = config(DPOConfig, model_dir, sft_rows, tmp_path / "run2", "train.max_steps=1")
    with pytest.raises(DataError, match="needs preference pairs"):
        train_dpo(cfg)


def test_grad_accum_split_gives_the_same_step(tiny, tmp_path):
    model_dir, data = tiny
    records = []
    for batch, accum in ((4, 1), (2, 2)):
        cfg = config(
            DPOConfig,
            model_dir,
            data,
            tmp_path / f"b{batch}",
            "train.max_steps=2",
            f"train.batch_size={batch}",
            f"train.grad_accum={accum}",
            "optim.lr=1e-3",
            "optim.schedule=constant",
        )
        records.append([r for r in read_metrics(train_dpo(cfg)) if "loss" in r])
    for a, b in zip(*records):  # same pairs per step (the stream's order does not depend on the batch size)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)

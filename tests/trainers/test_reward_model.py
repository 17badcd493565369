from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain.algos.reward import bradley_terry_loss
from posttrain.cli import main
from posttrain.data.preference_pairs import PairRow, load_pairs
from posttrain.data.tokenize import TokenizedRow
from posttrain.data.validate import DataError
from posttrain.models.hub import load_model
from posttrain.rewards.model_reward import RewardModelScorer, tokenize_pair_for_scoring
from posttrain.trainers.reward_model import (
    RewardModel,
    RMConfig,
    new_score_head,
    pack_sequences,
    pair_scores,
    shared_start,
    train_reward_model,
)
from tests.trainers.pref_helpers import config, pair_rows, read_metrics, setup_dir, write_jsonl


def test_bradley_terry_loss_values():
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 1.0, 2.0])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    expected = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    torch.testing.assert_close(loss, expected)
    assert float(metrics["accuracy"]) == pytest.approx(1 / 3)
    loss_c, _ = bradley_terry_loss(chosen, rejected, center_coefficient=0.1)
    torch.testing.assert_close(loss_c, expected + 0.1 * (chosen + rejected).square().mean())


def test_rm_accuracy_rises_and_saved_model_scores_through_scorer(tmp_path):
    model_dir, data = setup_dir(tmp_path)
    cfg = config(
        RMConfig,
        model_dir,
        data,
        tmp_path / "run",
        "train.max_steps=10",
        "train.batch_size=8",
        "optim.lr=3e-3",
        "optim.warmup_ratio=0",
        "optim.schedule=constant",
    )
    run_dir = train_reward_model(cfg)
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert records[-1]["accuracy"] == 1.0 and records[-1]["accuracy"] > records[0]["accuracy"] - 1e-9
    assert records[-1]["loss"] < records[0]["loss"]
    final = run_dir / "final"
    assert (final / "score.safetensors").is_file()
    scorer = RewardModelScorer(final, device="cpu")
    rows = pair_rows()
    prompts = [r["prompt"] for r in rows]
    chosen = scorer(prompts, [r["chosen"] for r in rows])
    rejected = scorer(prompts, [r["rejected"] for r in rows])
    assert all(c > r for c, r in zip(chosen, rejected))  # the trained preference survives the round trip


def test_rm_held_out_eval_and_cli(tmp_path):
    model_dir, data = setup_dir(tmp_path)
    assert (
        main(
            [
                "rm",
                f"model.name_or_path={model_dir}",
                f"data.path={data}",
                f"out={tmp_path / 'cli'}",
                "train.max_steps=1",
                "train.progress=false",
                "data.eval_fraction=0.25",
            ]
        )
        == 0
    )
    records = read_metrics(tmp_path / "cli")
    assert records[0]["step"] == 0 and records[0]["eval_pairs"] == 2 and "eval_accuracy" in records[-1]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "rejected": " no"}] * 3)
    cfg = config(RMConfig, model_dir, bad, tmp_path / "bad", "data.format=preference")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing field 'chosen'"):
        train_reward_model(cfg)


@pytest.mark.parametrize("share", [True, False])
def test_packed_pair_scores_equal_each_sequence_scored_alone(tmp_path, share):
    """A pair packed into one row (the shared start once) scores each sequence as a row of its own would; a
    micro-batch with a pair that shares nothing takes 2B padded rows, with the same scores."""
    model_dir, data = setup_dir(tmp_path)
    model, tok = load_model(model_dir)
    rm = RewardModel(model, new_score_head(model.config.hidden_size, "cpu")).eval()
    cfg = config(RMConfig, model_dir, data, tmp_path / "unused")
    pairs = load_pairs(cfg.data, tok, 0, tokenize=tokenize_pair_for_scoring).train[:4]
    assert all(shared_start(p) > 0 for p in pairs)
    if not share:
        first = pairs[0]
        ids = [(first.rejected.input_ids[0] + 1) % model.config.vocab_size, *first.rejected.input_ids[1:]]
        pairs[0] = dataclasses.replace(first, rejected=dataclasses.replace(first.rejected, input_ids=ids))
    assert (pack_sequences(pairs, "cpu") is not None) == share
    with torch.no_grad():
        chosen, rejected = pair_scores(rm, pairs, tok.pad_token_id)
        for i, pair in enumerate(pairs):
            for got, row in ((chosen[i], pair.chosen), (rejected[i], pair.rejected)):
                alone = rm(torch.tensor([row.input_ids]), torch.tensor([len(row)]))[0]
                torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_shared_start_leaves_each_sequence_its_last_token():
    rows = [TokenizedRow(ids, [-100] * len(ids)) for ids in ([1, 2, 3], [1, 2, 3, 4], [1, 2], [5, 2, 3])]
    assert shared_start(PairRow(rows[0], rows[1])) == 2  # the shorter keeps its last token
    assert shared_start(PairRow(rows[0], rows[0])) == 2
    assert shared_start(PairRow(rows[2], rows[0])) == 1
    assert shared_start(PairRow(rows[0], rows[3])) == 0  # nothing shared: the pair does not pack

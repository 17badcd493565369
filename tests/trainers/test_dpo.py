from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos.preference import PREFERENCE_LOSSES
from posttrain.cli import main
from posttrain.config import parse_cli_config
from posttrain.data.preference_pairs import load_pairs
from posttrain.data.validate import DataError
from posttrain.errors import ConfigError
from posttrain.models.hub import load_model
from posttrain.trainers.preference.dpo import DPOConfig, train_dpo
from posttrain.trainers.preference.logps import collate_pairs, sequence_logps
from tests.trainers.pref_helpers import config, read_metrics, setup_dir, write_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return setup_dir(tmp_path_factory.mktemp("dpo"))


def test_policy_logps_match_transformers_forward(tiny):
    transformers = pytest.importorskip("transformers")
    model_dir, data = tiny
    model, tok = load_model(model_dir)
    cfg = config(DPOConfig, model_dir, data, model_dir / "unused")
    pairs = load_pairs(cfg.data, tok, seed=0).train[:3]
    batch = collate_pairs(pairs, tok.pad_token_id)
    with torch.no_grad():
        ours, lengths = sequence_logps(model, batch)
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

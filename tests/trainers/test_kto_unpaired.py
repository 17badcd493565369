"""`posttrain dpo --loss kto` on unpaired prompt/completion/label rows."""

from __future__ import annotations

import json
import math

import pytest

from posttrain.cli import main
from posttrain.data.config import DataConfig
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.data.validate import DataError
from posttrain.errors import ConfigError
from posttrain.models.hub import load_model
from posttrain.trainers.preference.dpo import DPOConfig, train_dpo
from posttrain.trainers.preference.unpaired import UnpairedRow, fixed_batches, kl_rows, load_unpaired
from tests.trainers.pref_helpers import PAIRS, config, read_metrics, setup_dir, write_jsonl


def unpaired_rows() -> list[dict]:
    """16 rows, desirable and undesirable interleaved unevenly (11 / 5), as a KTO file may hold them."""
    rows = []
    for n, (a, b) in enumerate(PAIRS + [(b, a) for a, b in PAIRS]):
        good = n % 3 != 2
        rows.append(
            {
                "prompt": f"What is {a} plus {b}?",
                "completion": f" The answer is {a + b}." if good else f" The sky is blue {a}.",
                "label": good,
            }
        )
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("kto")
    model_dir, _ = setup_dir(base)
    return model_dir, write_jsonl(base / "unpaired.jsonl", unpaired_rows())


def _row(prompt: list[int], completion: list[int]) -> UnpairedRow:
    return UnpairedRow(TokenizedRow(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion), True)


def test_fixed_batches_cover_every_row_and_kl_rows_rotate_within_a_batch():
    batches = fixed_batches(9, 4, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(9))
    assert [len(b) for b in batches] == [4, 5]  # the last row alone would be its own KL row: it joins the batch before
    rows = [_row([100 + i, 200 + i], [300 + i] * (i + 1)) for i in range(5)]
    kl = kl_rows(rows, [[3, 0, 4], [1, 2]], max_length=64)
    # TRL: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}) within each batch
    for prompt_of, completion_of in ((3, 4), (0, 3), (4, 0), (1, 2), (2, 1)):
        assert kl[prompt_of].input_ids == [100 + prompt_of, 200 + prompt_of] + [300 + completion_of] * (
            completion_of + 1
        )
        assert kl[prompt_of].labels[:2] == [IGNORE_INDEX] * 2


def test_kto_run_on_mixed_labels_logs_class_metrics_and_held_out_eval(tiny, tmp_path):
    model_dir, data = tiny
    cfg = config(
        DPOConfig,
        model_dir,
        data,
        tmp_path / "run",
        "loss=kto",
        "train.max_steps=8",
        "train.batch_size=4",
        "data.eval_fraction=0.25",
        "optim.lr=2e-3",
        "optim.warmup_ratio=0",
        "optim.schedule=constant",
        "beta=0.5",
        "undesirable_weight=1.2",
    )
    run_dir = train_dpo(cfg)
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["format"] == "unpaired_preference" and (report["desirable"], report["undesirable"]) == (11, 5)
    records = read_metrics(run_dir)
    before, steps = records[0], [r for r in records if "loss" in r]
    assert before["step"] == 0 and before["eval_rows"] == 4
    assert before["eval_desirable"] + before["eval_undesirable"] == 4
    assert before["eval_kl"] == pytest.approx(0.0, abs=1e-4)  # policy == reference before the first step
    for r in steps:
        assert r["desirable"] + r["undesirable"] == r["rows"] == 4
        assert math.isfinite(r["loss"]) and r["kl"] >= 0
    first = steps[0]
    assert first["loss"] == pytest.approx((first["desirable"] * 0.5 + first["undesirable"] * 0.6) / 4, abs=1e-4)
    trained = [r for r in steps if "rewards/margins" in r]
    assert trained and trained[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < first["loss"]
    assert math.isfinite(records[-1]["eval_loss"]) and "eval_rewards_chosen" in records[-1]
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_precomputed_and_live_reference_agree(tiny, tmp_path):
    model_dir, data = tiny
    runs = []
    for ref in ("precompute", "live"):
        cfg = config(
            DPOConfig,
            model_dir,
            data,
            tmp_path / ref,
            "loss=kto",
            f"reference={ref}",
            "train.max_steps=2",
            "train.batch_size=5",
            "optim.lr=1e-3",
            "data.eval_fraction=0.2",
        )
        runs.append([r for r in read_metrics(train_dpo(cfg)) if "loss" in r or "eval_loss" in r])
    for a, b in zip(*runs):
        for key in ("loss", "kl", "eval_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_cli_reads_an_unpaired_file(tiny, tmp_path):
    model_dir, data = tiny
    assert (
        main(
            [
                "dpo",
                "--loss",
                "kto",
                f"data.path={data}",
                f"model.name_or_path={model_dir}",
                f"out={tmp_path / 'cli'}",
                "--train.max_steps",
                "1",
                "--train.batch_size",
                "4",
                "--train.progress",
                "false",
            ]
        )
        == 0
    )
    assert "kl" in read_metrics(tmp_path / "cli")[-1]


def test_other_losses_refuse_an_unpaired_file_before_loading_a_model(tiny, tmp_path):
    _, data = tiny
    cfg = config(DPOConfig, tmp_path / "no-such-model", data, tmp_path / "run", "loss=sigmoid")
    with pytest.raises(
        DataError, match=r"unpaired rows \(prompt/completion/label\) train only loss=kto; loss='sigmoid'"
    ):
        train_dpo(cfg)


def test_label_that_is_not_a_bool_is_reported_with_file_and_line(tiny, tmp_path):
    model_dir, _ = tiny
    _, tok = load_model(model_dir)
    rows = unpaired_rows() * 2  # 32 rows; one bad label is under max_bad_row_fraction=0.05
    rows[4] = {**rows[4], "label": "yes"}
    one_bad = write_jsonl(tmp_path / "one_bad.jsonl", rows)
    data = load_unpaired(DataConfig(path=str(one_bad)), tok, seed=0, batch_size=4)
    assert len(data.train) == 31
    assert data.report["bad_rows"] == [
        {"location": f"{one_bad}:5", "reason": "field 'label' must be true/false, got 'yes'"}
    ]

    many_bad = write_jsonl(
        tmp_path / "many_bad.jsonl", [{**r, "label": "no"} if i % 2 else r for i, r in enumerate(rows)]
    )
    with pytest.raises(DataError, match=r"many_bad\.jsonl:2: field 'label' must be true/false, got 'no'"):
        load_unpaired(DataConfig(path=str(many_bad)), tok, seed=0, batch_size=4)


def test_bad_rows_are_skipped_and_batch_size_one_is_refused(tiny, tmp_path):
    model_dir, data = tiny
    _, tok = load_model(model_dir)
    rows = unpaired_rows() * 2
    rows[0] = {"prompt": "What is 1 plus 2?", "label": True}  # no completion
    rows[7] = {**rows[7], "completion": ""}
    path = write_jsonl(tmp_path / "some_bad.jsonl", rows)
    loaded = load_unpaired(DataConfig(path=str(path), max_bad_row_fraction=0.1), tok, seed=0, batch_size=4)
    assert [b["location"] for b in loaded.report["bad_rows"]] == [f"{path}:1", f"{path}:8"]
    assert len(loaded.train) == 30 and sum(map(len, loaded.train.batches)) == 30
    with pytest.raises(ConfigError, match="train.batch_size=1: kto on unpaired rows needs at least 2"):
        load_unpaired(DataConfig(path=str(data)), tok, seed=0, batch_size=1)

"""SFT: the loss against transformers, gradient accumulation, learning, and the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.cli import main as cli_main
from posttrain.config import load_config
from posttrain.data.collate import collate
from posttrain.data.formats import PromptCompletion
from posttrain.data.tokenize import IGNORE_INDEX, tokenize_sft
from posttrain.metrics import read_metrics
from posttrain.models.checkpoint_io import ours_to_hf
from posttrain.models.hub import load_model
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.sft import SFTConfig, sft_loss_sum, train_sft
from tests.data.tiny import QA, tiny_tokenizer
from tests.numeric import EQUIVALENCE_EPS, adam_drift, assert_reordered, reorder_close

ROOT = Path(__file__).resolve().parents[2]


def chat_rows(n: int = len(QA)):
    tok = tiny_tokenizer()
    return [
        tokenize_sft(tok, PromptCompletion([{"role": "user", "content": q}], [{"role": "assistant", "content": a}]))
        for q, a in QA[:n]
    ]


def base_overrides(model_dir: Path, data_file: Path, out: Path) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        f"data.path={data_file}",
        "data.columns={prompt: question, completion: answer}",
        "data.as_chat=true",
        f"out={out}",
        "train.progress=false",
    ]


def test_sft_loss_and_gradients_equal_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    ours, _ = load_model(model_dir, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    rows = chat_rows()
    batch = collate(rows, pad_token_id=2)
    loss = sft_loss_sum(ours, batch) / batch.num_targets
    labels = torch.full_like(batch.input_ids, IGNORE_INDEX)  # transformers takes unshifted labels
    for b, row in enumerate(rows):
        labels[b, : len(row)] = torch.tensor(row.labels)
    hf_loss = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
    # Two implementations of one forward: its sums in their own orders (tests/numeric.py).
    assert reorder_close(loss.item(), hf_loss.item())
    loss.backward()
    hf_loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        ours_grad, hf_grad = param.grad, hf_params[ours_to_hf(name)].grad
        if name == "embed_tokens.weight":
            # transformers builds the embedding with padding_idx = pad_token_id, which zeroes the input-side
            # gradient of that token (here <|im_end|>, also a real token); compare every other row.
            keep = torch.arange(ours_grad.shape[0]) != hf.config.pad_token_id
            ours_grad, hf_grad = ours_grad[keep], hf_grad[keep]
        assert_reordered(ours_grad, hf_grad, msg=name)


def grads_after(model, micro_batches, denominator):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(micro_batches, lambda b: (sft_loss_sum(model, b), {}), denominator)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_grad_accumulation_2x4_equals_batch_8(model_dir):
    model, _ = load_model(model_dir, device="cpu")
    rows = chat_rows(8)
    whole = collate(rows, 2)
    halves = [collate(rows[:4], 2), collate(rows[4:], 2)]
    assert halves[0].num_targets != halves[1].num_targets  # unequal halves: a mean of means would differ
    big = grads_after(model, [whole], whole.num_targets)
    accumulated = grads_after(model, halves, whole.num_targets)
    for name in big:  # micro-batches of other shapes (padding, rows): every sum may be reordered
        assert_reordered(accumulated[name], big[name], msg=name)
    # For contrast, the mean of per-micro-batch means is a different update: the test can tell them apart.
    mean_of_means = sum(grads_after(model, [h], 2 * h.num_targets)["embed_tokens.weight"] for h in halves)
    assert not torch.allclose(mean_of_means, big["embed_tokens.weight"], rtol=1e-3, atol=1e-6)


def test_grad_accumulation_through_the_trainer(model_dir, data_file, tmp_path):
    lr = 1e-2

    def final_weights(batch_size: int, grad_accum: int) -> dict[str, torch.Tensor]:
        cfg = load_config(
            SFTConfig,
            overrides=base_overrides(model_dir, data_file, tmp_path / f"run{batch_size}")
            + [
                f"train.batch_size={batch_size}",
                f"train.grad_accum={grad_accum}",
                "train.max_steps=2",
                f"optim.lr={lr}",
                f"optim.eps={EQUIVALENCE_EPS}",
            ],
        )  # AdamW's gain on the gradients' rounding (tests/numeric.py)
        run = train_sft(cfg)
        model, _ = load_model(run / "final", device="cpu")
        return model.state_dict()

    accumulated, whole = final_weights(4, 2), final_weights(8, 1)
    # Two AdamW updates from gradients whose sums ran in other orders (micro-batches of other shapes).
    bound = adam_drift(lr, 2, EQUIVALENCE_EPS)
    for name, tensor in whole.items():
        assert float((accumulated[name] - tensor).abs().max()) <= bound, name


def test_loss_falls_when_overfitting_a_few_rows(model_dir, data_file, tmp_path):
    cfg = load_config(
        SFTConfig,
        overrides=base_overrides(model_dir, data_file, tmp_path / "run")
        + ["data.max_rows=4", "train.batch_size=4", "train.max_steps=20", "optim.lr=1e-2", "optim.schedule=constant"],
    )
    records = read_metrics(train_sft(cfg))
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["loss"] < 0.3 * records[0]["loss"]


def test_cli_end_to_end(model_dir, data_file, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    code = cli_main(
        [
            "sft",
            *base_overrides(model_dir, data_file, out),
            "train.batch_size=2",
            "train.max_steps=3",
            "--train.save_every",
            "2",
            "data.eval_fraction=0.25",
            "optim.warmup_steps=1",
        ]
    )
    assert code == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = load_config(SFTConfig, out / "config.yaml")  # the saved config reloads as the same config
    assert config.train.max_steps == 3 and config.data.columns == {"prompt": "question", "completion": "answer"}
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens/train_per_s", "time/step_s", "tokens", "loss_tokens"):
        assert all(key in r for r in records), key
    assert "eval_loss" in records[-1]
    report = json.loads((out / "data_report.json").read_text())
    assert report["format"] == "prompt_completion" and report["rows_kept"] == len(QA)
    assert (out / "checkpoints" / "step-2" / "model.safetensors").is_file()
    model, tokenizer = load_model(out / "final", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}])])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_cli_reports_config_errors(capsys):
    assert cli_main(["sft", "train.batch_size=0", "data.path=x.jsonl"]) == 2
    assert "train: batch_size must be at least 1" in capsys.readouterr().err
    assert cli_main(["sft", "data.path=/nonexistent/train.jsonl", "model.name_or_path=/nonexistent/model"]) == 2


def test_example_config_is_valid():
    cfg = load_config(SFTConfig, ROOT / "examples" / "sft_gsm8k.yaml")
    assert (ROOT / cfg.data.path).is_file()

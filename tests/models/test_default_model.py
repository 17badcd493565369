"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF loader."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.models.checkpoint_io import load_hf_dir
from posttrain.models.hub import DEFAULT_MODEL, load_model

pytestmark = pytest.mark.slow  # the embedded default model, loaded and converted


@pytest.fixture(scope="module")
def ours():
    return load_model(DEFAULT_MODEL, device="cpu")


def test_gguf_logits_match_transformers(ours, hf_from_gguf):
    model, tokenizer = ours
    texts = ["The capital of France is", "def fibonacci(n):\n    return", "12 + 35 = 47, and 9 * 7 ="]
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)])
            diff = (model(ids) - hf_from_gguf(ids).logits).abs().max().item()
            assert diff <= 1e-4, (text, diff)


def test_default_model_config(ours):
    model, tokenizer = ours
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.tie_word_embeddings
    assert 134_000_000 < model.num_parameters() < 135_000_000
    assert model.dtype == torch.float32


def test_convert_round_trip(ours, tmp_path):
    """`posttrain convert` output loads in transformers and in posttrain with identical logits."""
    import transformers

    model, tokenizer = ours
    assert main(["convert", "--model", DEFAULT_MODEL, "--out", str(tmp_path / "out")]) == 0
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "Hi there!"}])])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        expected = model(ids)
        assert (hf(ids).logits - expected).abs().max().item() <= 1e-5
        assert torch.equal(load_hf_dir(tmp_path / "out")(ids), expected)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    assert main(["convert", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0]
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "llama" and info["attention"] == "GQA"
    assert info["weights_bytes"] == info["parameters"] * 4
    assert info["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 64 * 4


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["info", "--model", "/no/such/model"], "/no/such/model: no such file or directory"),
        (["info", "--model", "smollm2-135m", "--dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_cli_errors_are_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err

"""`posttrain quantize` and `posttrain eval ppl` end to end on a tiny model directory."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.eval.perplexity import evaluate_perplexity
from posttrain.quant import load_quantized
from tests.quant.tiny import write_tiny_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "gsm.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": "q", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}) for i in range(12))
        + "\n"
    )
    return write_tiny_dir(root / "tiny"), data


def test_quantize_then_eval_ppl(files, tmp_path, capsys):
    model_dir, data = files
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(model_dir), "--scheme", "int4-g32", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (
        main(
            [
                "eval",
                "ppl",
                "--model",
                str(out),
                "--data",
                str(data),
                "--column",
                "answer",
                "--skip",
                "2",
                "--max-rows",
                "8",
                "--batch-size",
                "3",
                "--json",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    model, tokenizer = load_quantized(out)
    expected = evaluate_perplexity(model, tokenizer, data, "answer", skip=2, max_rows=8)
    assert printed["task"] == "ppl" and printed["rows"] == 8 and printed["tokens"] == expected.tokens
    assert printed["perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)
    assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(data), "--column", "answer"]) == 0
    assert capsys.readouterr().out.startswith("perplexity ")


def test_cli_errors(files, tmp_path, capsys):
    model_dir, data = files
    assert main(["quantize", "--model", str(model_dir), "--scheme", "int3", "--out", str(tmp_path / "q")]) == 2
    assert "error: unknown quantization scheme 'int3' (choose from int8," in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["quantize", "--model", str(model_dir), "--scheme", "int8", "--out", str(tmp_path / "full")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(model_dir), "--data", str(data)]) == 2
    assert "gsm.jsonl:1: no column 'text' (columns: question, answer)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "bleu", "--model", str(model_dir)])
    assert "invalid choice: 'bleu'" in capsys.readouterr().err


def test_quantize_with_gptq(files, tmp_path, capsys):
    model_dir, data = files
    out = tmp_path / "gptq"
    assert (
        main(
            [
                "quantize",
                "--model",
                str(model_dir),
                "--scheme",
                "int4-g32",
                "--method",
                "gptq",
                "--calib-data",
                str(data),
                "--calib-column",
                "answer",
                "--calib-samples",
                "4",
                "--calib-seq-len",
                "32",
                "--no-clip-search",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "gptq: calibrating on 4 windows of 32 tokens" in printed and "int4-g32, gptq" in printed
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["method"] == "gptq" and config["gptq"]["act_order"] is True
    assert config["gptq"]["clip_search"] is False and config["gptq"]["true_sequential"] is True
    assert config["gptq"]["calibration_samples"] == 4
    model, _ = load_quantized(out)
    assert sum(type(m).__name__ == "QuantizedLinear" for m in model.modules()) == 14
    assert (
        main(
            [
                "quantize",
                "--model",
                str(model_dir),
                "--scheme",
                "int4-g32",
                "--method",
                "gptq",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "--method gptq needs calibration text: --calib-data FILE" in capsys.readouterr().err
    assert (
        main(
            [
                "quantize",
                "--model",
                str(model_dir),
                "--scheme",
                "int4-g32",
                "--method",
                "gptq",
                "--calib-data",
                str(data),
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )
    assert "gsm.jsonl:1: no column 'text' (columns: question, answer)" in capsys.readouterr().err
    assert (
        main(
            [
                "quantize",
                "--model",
                str(model_dir),
                "--scheme",
                "int4-g32",
                "--method",
                "gptq",
                "--calib-data",
                str(data),
                "--calib-column",
                "answer",
                "--calib-seq-len",
                "5000",
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )
    assert "fewer than one window of 5000" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()

"""models' loader registry: directory formats other packages write reach their loader through a
registered `DirFormat`, and models itself imports nothing of quant (the layout's direction)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from posttrain.models import dir_formats, hub
from posttrain.models.dir_formats import DirFormat, declares_quantization, register_dir_format
from posttrain.quant import QuantizedLinear, quantize_model, save_quantized
from tests.quant.tiny import char_tokenizer, tiny_model, write_tiny_dir

MODELS = Path(__file__).resolve().parents[2] / "posttrain" / "models"


def test_models_import_nothing_of_quant() -> None:
    offenders = []
    for file in sorted(MODELS.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            where = f"{file.relative_to(MODELS)}:{getattr(node, 'lineno', 0)}"
            offenders += [f"{where} {name}" for name in names if name.startswith("posttrain.quant")]
    assert offenders == []


def test_a_registered_format_gets_the_directories_it_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dir_formats, "_FORMATS", dict(dir_formats._FORMATS))  # this test's registrations only
    marked, plain = write_tiny_dir(tmp_path / "marked"), write_tiny_dir(tmp_path / "plain", seed=1)
    (marked / "MARK").touch()
    stand_in = tiny_model(seed=2)
    calls = []

    def load(path: Path, device: torch.device, dtype: torch.dtype | None) -> torch.nn.Module:
        calls.append((path, device, dtype))
        return stand_in

    register_dir_format(DirFormat("marked", lambda path: (path / "MARK").is_file(), load))
    model, tokenizer = hub.load_model(marked, dtype="bfloat16", device="cpu")
    assert model is stand_in and calls == [(marked, torch.device("cpu"), torch.bfloat16)]
    assert tokenizer.encode("a", add_special_tokens=False) == char_tokenizer().encode("a", add_special_tokens=False)
    model, _ = hub.load_model(plain, device="cpu")  # no format matches: the HF loader, as before
    assert model is not stand_in and calls == [(marked, torch.device("cpu"), torch.bfloat16)]


def test_the_package_registers_quantized_directories(tmp_path: Path) -> None:
    path = save_quantized(quantize_model(tiny_model(), "int8"), tmp_path / "q", char_tokenizer())
    assert declares_quantization(path) and not declares_quantization(write_tiny_dir(tmp_path / "plain"))
    assert dir_formats.dir_format(path).name == "posttrain quantize directory"
    model, _ = hub.load_model(path, device="cpu")
    assert any(isinstance(m, QuantizedLinear) for m in model.modules())

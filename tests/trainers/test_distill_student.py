"""Layer-dropped students (`posttrain convert --num-layers / --keep-layers`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from posttrain.cli import main
from posttrain.errors import PosttrainError
from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.hub import load_model
from posttrain.models.transformer import Transformer
from posttrain.trainers.distill_student import evenly_spaced_layers, keep_layers, parse_layer_list
from tests.data.tiny import tiny_model_config, tiny_tokenizer

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])


def four_layer_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(tiny_model_config(), num_hidden_layers=4))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def test_layer_selection():
    assert evenly_spaced_layers(30, 15) == list(range(0, 30, 2))
    assert evenly_spaced_layers(4, 4) == [0, 1, 2, 3] and evenly_spaced_layers(30, 10) == list(range(0, 30, 3))
    assert parse_layer_list("0, 2,3", 4) == [0, 2, 3]
    for text, match in (("2,1", "increasing"), ("0,4", r"0\.\.3"), ("a,b", "comma-separated"), ("", "at least one")):
        with pytest.raises(PosttrainError, match=match):
            parse_layer_list(text, 4)
    with pytest.raises(PosttrainError, match="cannot keep 5 of 4"):
        evenly_spaced_layers(4, 5)


def test_keeping_every_layer_is_the_same_model_and_copies_the_weights():
    model = four_layer_model()
    same = keep_layers(model, [0, 1, 2, 3])
    with torch.no_grad():
        torch.testing.assert_close(same(IDS), model(IDS))
        same.layers[0].mlp.down_proj.weight.zero_()
    assert model.layers[0].mlp.down_proj.weight.abs().sum() > 0  # a copy: training the student leaves the teacher
    assert same.lm_head.weight is same.embed_tokens.weight  # still tied


def test_convert_keep_layers_matches_transformers_with_the_same_layers_removed(tmp_path):
    transformers = pytest.importorskip("transformers")
    teacher_dir = save_hf_dir(four_layer_model(), tmp_path / "teacher", tokenizer=tiny_tokenizer())
    student_dir = tmp_path / "student"
    assert main(["convert", "--model", str(teacher_dir), "--out", str(student_dir), "--keep-layers", "0,2"]) == 0
    assert json.loads((student_dir / "config.json").read_text())["num_hidden_layers"] == 2

    hf = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    hf.model.layers = torch.nn.ModuleList([hf.model.layers[0], hf.model.layers[2]])
    for new, layer in enumerate(hf.model.layers):
        layer.self_attn.layer_idx = new
    hf.config.num_hidden_layers = 2
    student, _ = load_model(student_dir, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expected = hf(IDS, use_cache=False).logits
        torch.testing.assert_close(student(IDS), expected, rtol=1e-4, atol=1e-4)


def test_convert_num_layers_and_refusals(tmp_path, capsys):
    teacher_dir = save_hf_dir(four_layer_model(), tmp_path / "teacher", tokenizer=tiny_tokenizer())
    assert main(["convert", "--model", str(teacher_dir), "--out", str(tmp_path / "half"), "--num-layers", "2"]) == 0
    assert "kept 2 of 4 layers: 0,2" in capsys.readouterr().out
    assert main(["convert", "--model", str(teacher_dir), "--out", str(tmp_path / "bad"), "--keep-layers", "3,1"]) == 2
    assert "increasing" in capsys.readouterr().err

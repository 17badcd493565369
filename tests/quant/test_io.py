"""Quantized directories: save/load round trips and every corrupt-input error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.errors import CheckpointError
from posttrain.quant import (
    QuantizedLinear,
    is_quantized_dir,
    load_quantized,
    load_quantized_dir,
    quantize_model,
    save_quantized,
)
from tests.quant.tiny import char_tokenizer, tiny_model

IDS = torch.arange(0, 120, 5).view(2, 12)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def saved(tmp_path):
    model = quantize_model(tiny_model(), "int4-g32-asym")
    return save_quantized(model, tmp_path / "q", char_tokenizer()), model


@pytest.mark.parametrize(
    "name, family",
    [
        ("int8", {}),
        ("int4-g128-asym", {}),
        ("w8a8", {}),
        ("int4-g64", {"model_type": "qwen2", "tie_word_embeddings": False}),
    ],
)
def test_round_trip_gives_identical_outputs(tmp_path, name, family):
    model = quantize_model(tiny_model(**family), name)
    save_quantized(model, tmp_path / "q", char_tokenizer())
    loaded, tokenizer = load_quantized(tmp_path / "q")
    assert tokenizer.encode("ab", add_special_tokens=True) == [1, 68, 69]
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(before[k].dtype == after[k].dtype for k in before)
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))
    assert not loaded.training


def test_directory_contents(saved):
    path, _ = saved
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "posttrain",
        "format_version": 1,
        "scheme": "int4-g32-asym",
        "bits": 4,
        "group_size": 32,
        "symmetric": False,
        "activation_bits": None,
        "int4_layout": "tiles64",
        "scale_dtype": "float16",
        "modules_not_converted": ["lm_head", "embed_tokens"],
    }
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (
        1,
        96,
        32,
    )  # 1 tile of 64 rows, 96 inputs, 32 bytes
    assert tensors["model.layers.0.mlp.up_proj.qweight"].shape == (2, 64, 32)  # 96 rows: 2 tiles, the last half padding
    assert tensors["model.layers.0.mlp.down_proj.qweight"].dtype == torch.uint8
    assert tensors["model.layers.0.mlp.down_proj.scales"].shape == (64, 3)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32 and "lm_head.weight" not in tensors
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in path.iterdir()}
    assert sorted(p.name for p in path.parent.iterdir()) == ["q"]  # written atomically: no temp dir left


def test_is_quantized_dir(saved, tmp_path):
    path, _ = saved
    assert is_quantized_dir(path)
    assert not is_quantized_dir(tmp_path / "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert not is_quantized_dir(tmp_path / "broken")


def test_load_with_dtype_casts_float_tensors_only(saved):
    path, _ = saved
    model = load_quantized_dir(path, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantizedLinear) and layer.scales.dtype == torch.float16


def test_hub_load_model_reads_a_quantized_dir(saved):
    from posttrain.models import hub

    path, model = saved
    loaded, _ = hub.load_model(path, device="cpu")
    assert any(isinstance(m, QuantizedLinear) for m in loaded.modules())  # kept quantized, not dequantized
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))


@pytest.mark.parametrize("load", ["from posttrain.models.hub import load_model", "from posttrain import load_model"])
def test_a_fresh_process_loads_a_quantized_dir_without_importing_quant_first(saved, load):
    # models imports nothing of quant: the directory reaches quant's loader through the format the
    # package registers, in a process where nothing imported quant before the load.
    path, _ = saved
    code = (
        f"import sys; {load}; assert not any(m.startswith('posttrain.quant') for m in sys.modules); "
        "model, _ = load_model(sys.argv[1], device='cpu'); from posttrain.quant import QuantizedLinear; "
        "print(sum(isinstance(m, QuantizedLinear) for m in model.modules()))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == sum(isinstance(m, QuantizedLinear) for m in saved[1].modules()) > 0


def test_save_needs_a_quantized_model(tmp_path):
    with pytest.raises(CheckpointError, match="no quantized layers"):
        save_quantized(tiny_model(), tmp_path / "x")


# ---- corrupt directories: one clear error each ------------------------------------------------------------


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, change):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


Q = "model.layers.1.self_attn.v_proj"


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: edit_config(p, scheme="int3"), r"quantization_config.scheme='int3' is unknown \(known: int8,"),
        (lambda p: edit_config(p, quant_method="gptq"), r"quant_method='gptq' is not supported"),
        (lambda p: edit_config(p, format_version=9), r"format_version=9"),
        (
            lambda p: edit_config(p, group_size=128),
            r"group_size=128 contradicts scheme 'int4-g32-asym' \(group_size=32\)",
        ),
        (lambda p: edit_config(p, int4_layout="plain"), r"int4_layout='plain'"),
        (
            lambda p: edit_tensors(p, lambda t: t.__setitem__(f"{Q}.scales", t[f"{Q}.scales"][:, :1].clone())),
            rf"tensor '{Q}.scales' has shape \(32, 1\), the config and scheme imply \(32, 2\)",
        ),
        (
            lambda p: edit_tensors(p, lambda t: t.__setitem__(f"{Q}.qweight", t[f"{Q}.qweight"].to(torch.int8))),
            rf"tensor '{Q}.qweight' is torch.int8, the scheme stores torch.uint8",
        ),
        (
            lambda p: edit_tensors(p, lambda t: t[f"{Q}.scales"].__setitem__((0, 0), float("nan"))),
            rf"{Q}.scales holds non-finite or zero values",
        ),
        (lambda p: edit_tensors(p, lambda t: t.pop(f"{Q}.zeros")), rf"missing tensors {Q}.zeros"),
        (
            lambda p: edit_tensors(
                p, lambda t: t.__setitem__("model.layers.0.mlp.foo.qweight", t[f"{Q}.qweight"].clone())
            ),
            r"quantized tensor model.layers.0.mlp.foo.qweight names no layer",
        ),
        (
            lambda p: edit_tensors(
                p, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.int32))
            ),
            r"tensor 'model.norm.weight' is torch.int32, expected a float tensor",
        ),
        (
            lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:5000]),
            r"cannot read safetensors \(truncated or corrupt",
        ),
    ],
)
def test_corrupt_directory_errors(saved, corrupt, message):
    path, _ = saved
    corrupt(path)
    with pytest.raises(CheckpointError, match=message):
        load_quantized_dir(path)


def test_config_without_qweights_and_bad_section(saved):
    path, _ = saved
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = "int8"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config must be a JSON object, got str"):
        load_quantized_dir(path)
    config["quantization_config"] = {
        "quant_method": "posttrain",
        "format_version": 1,
        "scheme": "int8",
        "bits": 8,
        "group_size": None,
        "symmetric": True,
        "activation_bits": None,
        "int4_layout": None,
        "scale_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has no .qweight tensors"):
        load_quantized_dir(path)

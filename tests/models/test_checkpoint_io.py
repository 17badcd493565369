"""HF directory I/O: round trips through transformers, sharded checkpoints, and every bad-input error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.errors import CheckpointError
from posttrain.models import checkpoint_io
from posttrain.models.checkpoint_io import load_hf_dir, save_hf_dir
from posttrain.models.hub import resolve_model_path
from tests.hf_oracle import save_hf_model

IDS = torch.arange(0, 120, 3).view(2, 20)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    save_hf_model("qwen2", directory)
    return directory


@pytest.mark.parametrize("family", ["smollm2", "qwen3", "llama3"])
def test_save_loads_in_transformers_with_identical_logits(family, tmp_path):
    import transformers

    save_hf_model(family, tmp_path / "src")
    ours = load_hf_dir(tmp_path / "src").eval()
    save_hf_dir(ours, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    again = load_hf_dir(tmp_path / "out").eval()
    with torch.no_grad():
        expected = ours(IDS)
        assert (hf(IDS).logits - expected).abs().max().item() <= 1e-5
        assert torch.equal(again(IDS), expected)


def test_bf16_save_records_dtype(qwen2_dir, tmp_path):
    ours = load_hf_dir(qwen2_dir)
    save_hf_dir(ours, tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_hf_dir(tmp_path / "out").dtype == torch.float32  # loads in the dtype asked for
    assert next(iter(load_file(str(tmp_path / "out" / "model.safetensors")).values())).dtype == torch.bfloat16


def test_sharded_checkpoint_loads(qwen2_dir, tmp_path):
    tensors = load_file(str(qwen2_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(qwen2_dir / "config.json", tmp_path / "config.json")
    with torch.no_grad():
        assert torch.equal(load_hf_dir(tmp_path)(IDS), load_hf_dir(qwen2_dir)(IDS))


def test_failed_save_leaves_previous_checkpoint_intact(qwen2_dir, tmp_path, monkeypatch):
    ours = load_hf_dir(qwen2_dir)
    save_hf_dir(ours, tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io, "save_file", crash)
    with pytest.raises(OSError):
        save_hf_dir(ours, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp directory left behind


# ---- bad input: one clear error naming the file and the problem -----------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve_model_path(tmp_path / "nope")


def test_truncated_safetensors(qwen2_dir, tmp_path):
    shutil.copytree(qwen2_dir, tmp_path / "m")
    data = (tmp_path / "m" / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors"):
        load_hf_dir(tmp_path / "m")


def test_unsupported_architecture(qwen2_dir, tmp_path):
    shutil.copytree(qwen2_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture model_type='gpt_neox'"):
        load_hf_dir(tmp_path / "m")


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_config_missing_required_key(qwen2_dir, tmp_path, key):
    shutil.copytree(qwen2_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg[key]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"config\.json: missing required key '{key}'"):
        load_hf_dir(tmp_path / "m")


def test_config_not_json(qwen2_dir, tmp_path):
    shutil.copytree(qwen2_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_hf_dir(tmp_path / "m")


def test_shape_mismatch_names_the_tensor(qwen2_dir, tmp_path):
    shutil.copytree(qwen2_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight' has shape"):
        load_hf_dir(tmp_path / "m")


def test_missing_tensor_is_named(qwen2_dir, tmp_path):
    shutil.copytree(qwen2_dir, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.norm\.weight"):
        load_hf_dir(tmp_path / "m")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="missing required key"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vocab_size": 8,
            }
        )
    )
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_dir(tmp_path)


def test_pickle_weights_are_refused(tmp_path):
    """A directory holding only pytorch_model.bin is not read: we never unpickle."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vocab_size": 8,
            }
        )
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_dir(tmp_path)

"""PEFT-format adapters both ways against peft itself (the oracle), on tiny random models of two families,
and every class of bad adapter with its message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.errors import CheckpointError, PosttrainError
from posttrain.models.checkpoint_io import load_hf_dir
from posttrain.peft import (
    LoraConfig,
    apply_lora,
    load_peft_adapter,
    lora_layers,
    peft_format,
    save_peft_adapter,
    set_adapter,
)
from tests.peft.lora_helpers import hf_model, random_ids, randomize_adapters, randomize_peft

peft = pytest.importorskip("peft", reason="peft is the oracle for the adapter format")
transformers = pytest.importorskip("transformers")

TOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def max_diff(ours, reference, ids) -> float:
    with torch.no_grad():
        return (ours(ids) - reference(ids).logits).abs().max().item()


@pytest.mark.parametrize(
    "family, cfg",
    [
        ("llama", LoraConfig(r=4, alpha=8, target_modules="all-linear")),
        (
            "qwen2",
            LoraConfig(r=8, alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]),
        ),
    ],
)
def test_ours_to_peft_identical_logits(tiny_dirs, tmp_path, family, cfg):
    ours = apply_lora(load_hf_dir(tiny_dirs[family]).eval(), cfg)
    randomize_adapters(ours)
    out = save_peft_adapter(ours, tmp_path / "adapter", tiny_dirs[family])
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tiny_dirs[family]) and saved["use_rslora"] == cfg.use_rslora
    assert Q_A in load_file(out / "adapter_model.safetensors")
    reference = peft.PeftModel.from_pretrained(hf_model(tiny_dirs[family]), out).eval()
    ids = random_ids((2, 13))
    assert max_diff(ours, reference, ids) <= TOL
    with torch.no_grad():  # and the adapter does change the output
        assert (ours(ids) - reference.get_base_model()(ids).logits).abs().max() <= TOL
        with reference.disable_adapter():
            assert (ours(ids) - reference(ids).logits).abs().max() > 1e-3


def test_ours_to_peft_partial_targets_write_full_names(tiny_dirs, tmp_path):
    """Layer 1's q_proj and the (untied) lm_head only: leaf names would select more, so full names are written."""
    ours = apply_lora(
        load_hf_dir(tiny_dirs["llama"]).eval(),
        LoraConfig(r=2, alpha=2, target_modules=["layers.1.self_attn.q_proj", "lm_head"]),
    )
    randomize_adapters(ours)
    out = save_peft_adapter(ours, tmp_path / "adapter", "tiny-llama")
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == [
        "lm_head",
        "model.layers.1.self_attn.q_proj",
    ]
    reference = peft.PeftModel.from_pretrained(hf_model(tiny_dirs["llama"]), out).eval()
    assert max_diff(ours, reference, random_ids((1, 9))) <= TOL


@pytest.mark.parametrize(
    "family, kwargs",
    [
        (
            "llama",
            dict(
                r=4,
                lora_alpha=16,
                target_modules="all-linear",
                use_rslora=True,
                lora_dropout=0.1,
                rank_pattern={"down_proj": 2},
                alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3},
            ),
        ),
        (
            "qwen2",
            dict(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj", "up_proj"], exclude_modules=r".*\.1\.mlp\..*"),
        ),
    ],
)
def test_peft_to_ours_identical_logits(tiny_dirs, tmp_path, family, kwargs):
    reference = peft.get_peft_model(hf_model(tiny_dirs[family]), peft.LoraConfig(task_type="CAUSAL_LM", **kwargs))
    randomize_peft(reference)
    reference.save_pretrained(tmp_path / "adapter")
    reference.eval()
    ours = load_peft_adapter(load_hf_dir(tiny_dirs[family]).eval(), tmp_path / "adapter")
    ids = random_ids((2, 13))
    assert max_diff(ours, reference, ids) <= TOL
    expected = {
        n.removeprefix("base_model.model.model.").removesuffix(".base_layer")
        for n, m in reference.named_modules()
        if n.endswith("base_layer")
    }
    assert set(lora_layers(ours)) == expected
    assert all(not p.requires_grad for p in ours.parameters())  # loaded for inference unless trainable=True
    # ... and back again: what we write from a peft-loaded adapter (with its patterns) peft reads the same
    save_peft_adapter(ours, tmp_path / "again", "tiny")
    again = peft.PeftModel.from_pretrained(hf_model(tiny_dirs[family]), tmp_path / "again").eval()
    assert max_diff(ours, again, ids) <= TOL


def test_load_trainable_and_named(tiny_dirs, tmp_path):
    ours = apply_lora(load_hf_dir(tiny_dirs["llama"]).eval(), LoraConfig(r=4, alpha=8))
    randomize_adapters(ours)
    save_peft_adapter(ours, tmp_path / "a", "tiny")
    model = load_hf_dir(tiny_dirs["llama"]).eval()
    load_peft_adapter(model, tmp_path / "a", adapter_name="second")
    load_peft_adapter(model, tmp_path / "a", adapter_name="first", trainable=True)  # freezes all else
    assert all(p.requires_grad == (".first." in n) for n, p in model.named_parameters())
    ids = random_ids((1, 7))
    set_adapter(model, "first")
    with torch.no_grad():
        assert torch.equal(model(ids), ours(ids))
    with pytest.raises(PosttrainError, match="adapter 'first' already exists"):
        load_peft_adapter(model, tmp_path / "a", adapter_name="first")


def test_failed_save_leaves_previous_adapter_intact(tiny_dirs, tmp_path, monkeypatch):
    ours = apply_lora(load_hf_dir(tiny_dirs["llama"]), LoraConfig(r=4, alpha=8))
    out = save_peft_adapter(ours, tmp_path / "adapter", "tiny")
    before = (out / "adapter_model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(peft_format, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter(ours, out, "tiny")
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


# ---- bad adapters ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_adapter(tiny_dirs, tmp_path_factory):
    ours = apply_lora(load_hf_dir(tiny_dirs["llama"]), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    return save_peft_adapter(ours, tmp_path_factory.mktemp("good") / "adapter", "tiny-llama")


@pytest.fixture
def bad(good_adapter, tmp_path):
    directory = tmp_path / "bad"
    shutil.copytree(good_adapter, directory)
    return directory


def edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_tensors(directory, change):
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def expect_refusal(tiny_dirs, directory, pattern):
    model = load_hf_dir(tiny_dirs["llama"])
    with pytest.raises(CheckpointError, match=pattern):
        load_peft_adapter(model, directory)
    assert not lora_layers(model)  # nothing was changed


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(use_dora=True), "use_dora=true asks for DoRA, which is not supported"),
        (dict(bias="all"), 'bias="all" trains base-layer biases'),
        (dict(modules_to_save=["lm_head"]), r'modules_to_save=\["lm_head"\] asks for extra modules trained in full'),
        (dict(layers_to_transform=[0]), r"layers_to_transform=\[0\] asks for a subset of layers"),
        (dict(layers_to_transform=0), "layers_to_transform=0 asks for a subset of layers"),
        (dict(lora_bias=True), "lora_bias=true asks for a bias on lora_B"),
        (dict(init_lora_weights="pissa"), 'init_lora_weights="pissa" changes the base weights'),
        (dict(peft_type="IA3"), 'peft_type="IA3" is not supported'),
        (dict(task_type="SEQ_CLS"), 'task_type="SEQ_CLS" is not supported'),
        (dict(shiny_new_option={"on": 1}), "shiny_new_option=.* is an option this loader does not know"),
        (dict(r=0), "r=0 must be a positive integer"),
        (dict(target_modules=["q_proj", "c_attn"]), "target_modules entry 'c_attn' matches no module of the model"),
        (
            dict(target_modules=["q_proj", "v_proj", "k_proj"]),
            "missing tensor 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight'",
        ),
        (
            dict(target_modules=["q_proj"]),
            "tensors for module 'model.layers.0.self_attn.v_proj', which the config's target_modules does not select",
        ),
        (dict(r=8), rf"tensor '{Q_A}' has shape \(4, 64\), expected \(8, 64\)"),
    ],
)
def test_bad_config(tiny_dirs, bad, changes, pattern):
    edit_config(bad, **changes)
    expect_refusal(tiny_dirs, bad, r"adapter_config.json: " + pattern if "tensor" not in pattern else pattern)


def test_wrong_shape_names_the_tensor(tiny_dirs, bad):
    edit_tensors(bad, lambda t: t.update({Q_A: torch.zeros(4, 32)}))
    expect_refusal(
        tiny_dirs,
        bad,
        rf"adapter_model.safetensors: tensor '{Q_A}' has shape \(4, 32\), "
        r"expected \(4, 64\)",
    )


def test_module_the_model_lacks(tiny_dirs, bad):
    key = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    edit_tensors(bad, lambda t: t.update({key: torch.zeros(4, 64)}))
    expect_refusal(
        tiny_dirs, bad, f"tensor '{key}' is for module 'model.layers.7.self_attn.q_proj', which the model does not have"
    )


def test_unexpected_tensor_kind(tiny_dirs, bad):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    edit_tensors(bad, lambda t: t.update({key: torch.zeros(64)}))
    expect_refusal(tiny_dirs, bad, f"unexpected tensor '{key}'")


def test_truncated_safetensors(tiny_dirs, bad):
    path = bad / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    expect_refusal(tiny_dirs, bad, "adapter_model.safetensors: cannot read safetensors")


def test_missing_files(tiny_dirs, bad, tmp_path):
    expect_refusal(tiny_dirs, tmp_path / "nowhere", "nowhere: no such adapter directory")
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    expect_refusal(tiny_dirs, bad, "adapter_model.bin is a pickle, which is never loaded")
    (bad / "adapter_model.bin").unlink()
    expect_refusal(tiny_dirs, bad, "no adapter_model.safetensors")
    (bad / "adapter_config.json").write_text("{not json")
    expect_refusal(tiny_dirs, bad, "adapter_config.json: not valid JSON")
    (bad / "adapter_config.json").unlink()
    expect_refusal(tiny_dirs, bad, "no adapter_config.json")

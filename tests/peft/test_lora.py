"""LoRALinear and the in-place operations on a tiny random model: init, scaling, dropout, gradients,
targets, merge / unmerge, disabling, several adapters, the engine's flat (N, d) path."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from posttrain.config import load_config
from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.attention import PagedAttentionMetadata
from posttrain.models.checkpoint_io import load_hf_dir
from posttrain.peft import (
    LoraConfig,
    LoRALinear,
    active_adapter,
    adapter_names,
    apply_lora,
    delete_adapter,
    disable_adapters,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
    merge_and_unload,
    merge_lora,
    merged_adapter,
    set_adapter,
    trainable_parameters,
    unmerge_lora,
)
from tests.peft.lora_helpers import random_ids, randomize_adapters


def test_untouched_lora_model_equals_base(llama):
    ids = random_ids((2, 11))
    with torch.no_grad():
        base = llama(ids)
        apply_lora(llama, LoraConfig(r=4, alpha=8))
        assert torch.equal(llama(ids), base)  # B = 0 exactly
    for layer in lora_layers(llama).values():
        assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
        bound = 1 / math.sqrt(layer.in_features)  # kaiming-uniform with a=sqrt(5), as peft
        A = layer.lora_A["default"].weight
        assert A.abs().max() <= bound and A.std() > 0.4 * bound


def test_gaussian_init_std_is_one_over_r():
    layer = LoRALinear(nn.Linear(512, 256))
    layer.add_adapter("g", r=4, alpha=4, init="gaussian")
    assert abs(layer.lora_A["g"].weight.std().item() - 0.25) < 0.01


@pytest.mark.parametrize("use_rslora", [False, True])
def test_forward_formula_and_rslora_scaling(use_rslora):
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    layer = LoRALinear(base)
    layer.add_adapter("a", r=4, alpha=8, use_rslora=use_rslora)
    nn.init.normal_(layer.lora_B["a"].weight)
    scaling = 8 / math.sqrt(4) if use_rslora else 8 / 4
    assert layer.scaling["a"] == scaling
    x = torch.randn(3, 5, 16)
    A, B = layer.lora_A["a"].weight, layer.lora_B["a"].weight
    expected = base(x) + x @ A.T @ B.T * scaling
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    assert LoraConfig(r=4, alpha=8, use_rslora=use_rslora).scaling == scaling


def test_flat_and_batched_inputs_agree():
    """The engine feeds (N, d); training feeds (B, T, d)."""
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 12))
    layer.add_adapter("a", r=4, alpha=8)
    nn.init.normal_(layer.lora_B["a"].weight)
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(layer(x.reshape(14, 16)), layer(x).reshape(14, 12), rtol=0, atol=1e-6)


def test_dropout_only_in_training(llama):
    apply_lora(llama, LoraConfig(r=4, alpha=8, dropout=0.5))
    randomize_adapters(llama)
    ids = random_ids((1, 9))
    with torch.no_grad():
        eval_out = llama(ids)
        assert torch.equal(llama(ids), eval_out)
        llama.train()
        train_a, train_b = llama(ids), llama(ids)
    assert not torch.allclose(train_a, train_b)
    assert not torch.allclose(train_a, eval_out)
    llama.eval()
    apply_lora(llama, LoraConfig(r=4, alpha=8, dropout=0.0), adapter_name="nodrop")
    with torch.no_grad():
        randomize_adapters(llama, "nodrop")
        llama.train()
        assert torch.equal(llama(ids), llama(ids))


def test_gradients_reach_only_the_adapters(llama):
    apply_lora(llama, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    randomize_adapters(llama)
    params = trainable_parameters(llama)
    lora_ids = {id(p) for n, p in llama.named_parameters() if ".lora_" in n}
    assert {id(p) for p in params} == lora_ids and len(params) == 2 * 2 * 2  # 2 layers x q,v x A,B
    llama.train()
    llama(random_ids((2, 9))).logsumexp(-1).mean().backward()
    for name, p in llama.named_parameters():
        if ".lora_" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_all_linear_targets_every_decoder_linear_not_lm_head(llama):
    apply_lora(llama, LoraConfig(target_modules="all-linear"))
    parent = {
        "q_proj": "self_attn",
        "k_proj": "self_attn",
        "v_proj": "self_attn",
        "o_proj": "self_attn",
        "gate_proj": "mlp",
        "up_proj": "mlp",
        "down_proj": "mlp",
    }
    assert set(lora_layers(llama)) == {f"layers.{i}.{parent[leaf]}.{leaf}" for i in range(2) for leaf in parent}
    assert isinstance(llama.lm_head, nn.Linear) and not isinstance(llama.lm_head, LoRALinear)


def test_target_forms(llama):
    """Leaf names, full names (ours or HF), a regex over HF names, exclusions, lm_head when untied."""
    apply_lora(llama, LoraConfig(target_modules=["model.layers.1.mlp.up_proj", "layers.0.self_attn.q_proj"]), "full")
    assert set(lora_layers(llama)) == {"layers.1.mlp.up_proj", "layers.0.self_attn.q_proj"}
    delete_adapter(llama, "full")
    assert not lora_layers(llama)
    apply_lora(llama, LoraConfig(target_modules=r"model\.layers\.1\..*_proj", exclude_modules=["o_proj"]), "re")
    assert set(lora_layers(llama)) == {
        "layers.1.self_attn.q_proj",
        "layers.1.self_attn.k_proj",
        "layers.1.self_attn.v_proj",
        "layers.1.mlp.gate_proj",
        "layers.1.mlp.up_proj",
        "layers.1.mlp.down_proj",
    }
    delete_adapter(llama, "re")
    apply_lora(llama, LoraConfig(target_modules=["lm_head"]))
    assert isinstance(llama.lm_head, LoRALinear)


def test_target_that_matches_nothing_names_it_and_lists_linears(llama):
    with pytest.raises(
        PosttrainError,
        match=r"'c_attn' matches no module.*q_proj, k_proj, v_proj, o_proj, "
        r"gate_proj, up_proj, down_proj, lm_head",
    ):
        apply_lora(llama, LoraConfig(target_modules=["q_proj", "c_attn"]))
    assert not lora_layers(llama)  # nothing changed
    with pytest.raises(
        PosttrainError, match="target 'layers.0.input_layernorm' is a RMSNorm; LoRA applies to Linear layers only"
    ):
        apply_lora(llama, LoraConfig(target_modules=["input_layernorm"]))


def test_tied_lm_head_is_refused(tiny_dirs):
    model = load_hf_dir(tiny_dirs["smollm2"])
    with pytest.raises(PosttrainError, match="lm_head shares its weight with embed_tokens.weight"):
        apply_lora(model, LoraConfig(target_modules=["q_proj", "lm_head"]))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("r", 0, "r must be a positive integer"),
        ("alpha", -1.0, "alpha must be a positive number"),
        ("dropout", 1.0, r"dropout must be in \[0, 1\)"),
        ("target_modules", [], "target_modules must name at least one module"),
        ("target_modules", "q_proj(", "not a valid regular expression"),
        ("init", "pissa", "init must be one of kaiming, gaussian"),
    ],
)
def test_config_validation(llama, field, value, message):
    cfg = LoraConfig(**{field: value})
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ConfigError, match=message):
        apply_lora(llama, cfg)


@dataclass
class TrainerLikeConfig:
    lora: LoraConfig | None = None


def test_config_loads_as_an_optional_section():
    assert load_config(TrainerLikeConfig).lora is None
    cfg = load_config(
        TrainerLikeConfig, overrides=["lora.r=8", "lora.target_modules=[q_proj,v_proj]", "lora.use_rslora=true"]
    ).lora
    assert (cfg.r, cfg.alpha, cfg.target_modules, cfg.use_rslora) == (8, 32.0, ["q_proj", "v_proj"], True)
    assert (
        load_config(TrainerLikeConfig, overrides=["lora.target_modules=all-linear"]).lora.target_modules == "all-linear"
    )
    with pytest.raises(ConfigError, match="lora: r must be a positive integer, got 0"):
        load_config(TrainerLikeConfig, overrides=["lora.r=0"])


def test_merge_unmerge_restores_weights_and_keeps_logits(llama):
    before = {n: p.detach().clone() for n, p in llama.named_parameters()}
    apply_lora(llama, LoraConfig(r=4, alpha=8, use_rslora=True))
    randomize_adapters(llama)
    ids = random_ids((2, 10))
    with torch.no_grad():
        unmerged = llama(ids)
        merge_lora(llama)
        assert merged_adapter(llama) == "default"
        torch.testing.assert_close(llama(ids), unmerged, rtol=0, atol=1e-5)
        with pytest.raises(PosttrainError, match="already merged"):
            merge_lora(llama)
        with pytest.raises(PosttrainError, match="merged"):
            set_adapter(llama, None)
        unmerge_lora(llama)
        with pytest.raises(PosttrainError, match="no adapter is merged"):
            unmerge_lora(llama)
        torch.testing.assert_close(llama(ids), unmerged, rtol=0, atol=1e-5)
    after = {n.replace(".base_layer", ""): p for n, p in llama.named_parameters() if ".lora_" not in n}
    for name, p in before.items():
        torch.testing.assert_close(after[name], p, rtol=0, atol=1e-6)


def test_merge_keeps_parameter_storage(llama):
    """Merging is in place: the engine and the optimizer keep seeing the same tensors."""
    q = llama.layers[0].self_attn.q_proj
    apply_lora(llama, LoraConfig(r=4, alpha=8))
    randomize_adapters(llama)
    ptr = q.weight.data_ptr()
    merge_lora(llama)
    assert llama.layers[0].self_attn.q_proj.base_layer is q and q.weight.data_ptr() == ptr


def test_disable_adapters_gives_the_base_and_restores(llama):
    ids = random_ids((1, 12))
    with torch.no_grad():
        base = llama(ids)
        apply_lora(llama, LoraConfig(r=4, alpha=8))
        randomize_adapters(llama)
        adapted = llama(ids)
        with disable_adapters(llama):
            assert torch.equal(llama(ids), base)
        assert torch.equal(llama(ids), adapted)
        merge_lora(llama)  # a merged adapter is taken out for the block and put back after
        with disable_adapters(llama):
            torch.testing.assert_close(llama(ids), base, rtol=0, atol=1e-5)
        assert merged_adapter(llama) == "default"
        torch.testing.assert_close(llama(ids), adapted, rtol=0, atol=1e-5)


def test_named_adapters_select_and_delete(llama):
    ids = random_ids((1, 8))
    apply_lora(llama, LoraConfig(r=4, alpha=8), adapter_name="math")
    randomize_adapters(llama, "math", seed=1)
    apply_lora(llama, LoraConfig(r=2, alpha=2, target_modules=["q_proj"]), adapter_name="code")
    randomize_adapters(llama, "code", seed=2)
    assert adapter_names(llama) == ["math", "code"] and active_adapter(llama) == "code"
    assert [p.requires_grad for p in trainable_parameters(llama)] and all(
        ".code." in n for n, p in llama.named_parameters() if p.requires_grad
    )
    with torch.no_grad():
        code = llama(ids)
        set_adapter(llama, "math")
        math_out = llama(ids)
        set_adapter(llama, None)
        base = llama(ids)
    assert not torch.allclose(code, math_out) and not torch.allclose(code, base)
    with pytest.raises(PosttrainError, match=r"no adapter 'chat' \(adapters: math, code\)"):
        set_adapter(llama, "chat")
    with pytest.raises(PosttrainError, match="already exists"):
        apply_lora(llama, LoraConfig(), adapter_name="math")
    delete_adapter(llama, "math")
    assert set(lora_layers(llama)) == {"layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"}
    set_adapter(llama, "code")
    with torch.no_grad():
        assert torch.equal(llama(ids), code)


def test_lora_state_dict_round_trip(tiny_dirs, llama):
    apply_lora(llama, LoraConfig(r=4, alpha=8))
    randomize_adapters(llama)
    state = {k: v.clone() for k, v in lora_state_dict(llama).items()}
    assert "layers.0.self_attn.q_proj.lora_A.default.weight" in state and len(state) == 2 * 7 * 2
    assert set(state) <= set(llama.state_dict())
    fresh = apply_lora(load_hf_dir(tiny_dirs["llama"]).eval(), LoraConfig(r=4, alpha=8))
    load_lora_state_dict(fresh, state)
    ids = random_ids((1, 8))
    with torch.no_grad():
        assert torch.equal(fresh(ids), llama(ids))
    bad = dict(state)
    bad["layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(3, 64)
    with pytest.raises(PosttrainError, match=r"lora_A.default.weight' has shape \(3, 64\), expected \(4, 64\)"):
        load_lora_state_dict(fresh, bad)
    del bad["layers.0.self_attn.q_proj.lora_A.default.weight"]
    with pytest.raises(PosttrainError, match="missing LoRA tensor 'layers.0.self_attn.q_proj.lora_A.default.weight'"):
        load_lora_state_dict(fresh, bad)


def test_merge_and_unload_gives_a_plain_model(tiny_dirs, llama):
    apply_lora(llama, LoraConfig(r=4, alpha=8))
    randomize_adapters(llama)
    ids = random_ids((1, 8))
    with torch.no_grad():
        adapted = llama(ids)
        merge_and_unload(llama)
        torch.testing.assert_close(llama(ids), adapted, rtol=0, atol=1e-5)
    assert not lora_layers(llama)
    assert set(llama.state_dict()) == set(load_hf_dir(tiny_dirs["llama"]).state_dict())


def test_paged_engine_path_matches_dense(llama):
    """The engine calls hidden_states with flat ids (N,), positions and a paged KV cache."""
    apply_lora(llama, LoraConfig(r=4, alpha=8))
    randomize_adapters(llama)
    cfg = llama.config
    seqs = [random_ids((5,), seed=3), random_ids((3,), seed=4)]
    block_size, num_blocks = 4, 6
    caches = [
        torch.zeros(2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    meta = PagedAttentionMetadata(
        kv_caches=caches,
        slot_mapping=torch.tensor([4, 5, 6, 7, 8, 12, 13, 14]),  # seq 0 in blocks 1, 2; seq 1 in block 3
        block_tables=torch.tensor([[1, 2], [3, 0]]),
        context_lens=torch.tensor([5, 3]),
        query_lens=torch.tensor([5, 3]),
        max_query_len=5,
    )
    ids_flat = torch.cat(seqs)  # (N,)
    positions = torch.cat([torch.arange(5), torch.arange(3)])
    with torch.no_grad():
        paged = llama.hidden_states(ids_flat, positions=positions, attn_meta=meta)  # (N, d)
        dense = torch.cat([llama.hidden_states(s[None])[0] for s in seqs])
    assert paged.shape == (8, cfg.hidden_size)
    torch.testing.assert_close(paged, dense, rtol=0, atol=1e-5)

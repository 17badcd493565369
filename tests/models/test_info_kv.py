"""`posttrain info` on the families beyond dense Llama: KV-cache bytes per token (the latent for MLA),
experts and sliding windows, with and without loading the weights."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from tests.data.tiny import tiny_tokenizer
from tests.models.sparse_oracle import save_sparse_hf_model


def _info(capsys, *args: str) -> dict:
    assert main(["info", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "qwen2_swa"])
def test_info_kv_bytes_per_token(family, tmp_path, capsys):
    hf = save_sparse_hf_model(family, tmp_path)
    tiny_tokenizer().save(tmp_path)  # a full load reads the tokenizer too
    cfg = hf.config
    loaded = _info(capsys, "--model", str(tmp_path))
    config_only = _info(capsys, "--model", str(tmp_path), "--config-only", "--dtype", "bfloat16")
    assert loaded["parameters"] == config_only["parameters"] == hf.num_parameters()
    assert config_only["dtype"] == "bfloat16"
    layers = cfg.num_hidden_layers
    if family == "deepseek_v3":
        assert loaded["attention"] == "MLA"
        # fp32 when loaded; the latent (kv_lora_rank) and the shared rotary key per layer.
        assert loaded["kv_cache_bytes_per_token"] == layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
        assert config_only["kv_cache_bytes_per_token"] == layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
        heads, qk, v = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        assert config_only["kv_cache_bytes_per_token_as_mha"] == layers * heads * (qk + v) * 2
        assert config_only["experts"].startswith(
            "2 of 8 per token (sigmoid_group_limited, shared expert 32) in 1 layers"
        )
    else:
        assert loaded["kv_cache_bytes_per_token"] == 2 * layers * cfg.num_key_value_heads * 16 * 4
    if family == "mixtral":
        assert loaded["active_parameters"] == loaded["parameters"] - layers * 2 * 3 * cfg.hidden_size * 96
    if family == "qwen2_swa":
        assert loaded["sliding_window"] == "6 tokens in 1 of 2 layers"

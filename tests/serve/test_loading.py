"""`--lora NAME=PATH` parsing and the KV budget split between served models (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.engine import EngineConfig
from posttrain.errors import PosttrainError
from posttrain.serve.loading import parse_lora_specs, split_kv_budget


def test_parse_lora_specs() -> None:
    assert parse_lora_specs(["math=/a/b", "code=c=d"]) == {"math": Path("/a/b"), "code": Path("c=d")}
    for bad in (["math"], ["=/a"], ["math="], ["a.b=/x"], ["m=/x", "m=/y"]):
        with pytest.raises(PosttrainError, match="--lora"):
            parse_lora_specs(bad)


def test_kv_budget_is_shared_evenly() -> None:
    assert split_kv_budget(EngineConfig(num_kv_blocks=100), 3, 1).num_kv_blocks == 33
    assert split_kv_budget(EngineConfig(kv_cache_bytes=1000), 2, 0).kv_cache_bytes == 500
    # a fraction applies to the memory still free when each engine starts; each ends up with f / k of it
    f, k, left, taken = 0.6, 3, 1.0, []
    for i in range(k):
        share = split_kv_budget(EngineConfig(kv_cache_memory_fraction=f), k, i).kv_cache_memory_fraction * left
        taken.append(share)
        left -= share
    assert taken == pytest.approx([f / k] * k)
    assert split_kv_budget(EngineConfig(num_kv_blocks=7), 1, 0).num_kv_blocks == 7

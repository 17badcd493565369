"""Build the served models: one module, the base plus each `--lora NAME=PATH` adapter, one engine each."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from posttrain.engine.config import EngineConfig
from posttrain.engine.llm_engine import LLMEngine
from posttrain.engine.speculative.decoder import load_draft_model
from posttrain.errors import PosttrainError
from posttrain.serve.async_engine import AsyncEngine, ServedModel


def parse_lora_specs(specs: list[str]) -> dict[str, Path]:
    """["math=/adapters/math", ...] -> {"math": Path(...)}; names must be unique and free of '.' and '='."""
    loras: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise PosttrainError(f"--lora {spec!r}: expected NAME=PATH")
        if "." in name or "/" in name:
            raise PosttrainError(f"--lora {spec!r}: the name {name!r} may not contain '.' or '/'")
        if name in loras:
            raise PosttrainError(f"--lora {spec!r}: the name {name!r} is given twice")
        loras[name] = Path(path)
    return loras


def split_kv_budget(config: EngineConfig, num_engines: int, index: int) -> EngineConfig:
    """The config of engine `index` of `num_engines`: each served model has its own KV pool, and the
    budget the user gave is shared evenly between them."""
    if num_engines == 1:
        return config
    if config.num_kv_blocks is not None:
        return dataclasses.replace(config, num_kv_blocks=max(1, config.num_kv_blocks // num_engines))
    if config.kv_cache_bytes is not None:
        return dataclasses.replace(config, kv_cache_bytes=max(1, config.kv_cache_bytes // num_engines))
    # A fraction applies to the memory still free when an engine starts: after i pools of f/k each,
    # taking f / (k - i*f) of what is left is f/k of the memory free at the start.
    fraction = config.kv_cache_memory_fraction
    return dataclasses.replace(config, kv_cache_memory_fraction=min(1.0, fraction / (num_engines - index * fraction)))


def build_served_models(
    model: torch.nn.Module,
    tokenizer: Any,
    name: str,
    loras: dict[str, Path] | None = None,
    config: EngineConfig | None = None,
) -> AsyncEngine:
    """The base model served as `name`, and each adapter (loaded onto the same module) as its own name."""
    loras = loras or {}
    if name in loras:
        raise PosttrainError(f"--lora {name}=...: the name is already the base model's served name")
    config = config or EngineConfig()
    select_adapter = None
    if loras:
        from posttrain.peft import load_peft_adapter, set_adapter

        for adapter, path in loras.items():
            load_peft_adapter(model, path, adapter_name=adapter)
        set_adapter(model, None)

        def select_adapter(adapter: str | None) -> None:
            set_adapter(model, adapter)

    names = [(name, None, None)] + [(adapter, adapter, name) for adapter in loras]
    # A speculative draft model is loaded once; each served model's engine drafts with it into its own KV pool.
    spec = config.speculative
    draft_model = load_draft_model(spec, model) if spec is not None and spec.method == "draft" else None
    served = []
    for i, (served_name, adapter, parent) in enumerate(names):
        cfg = split_kv_budget(config, len(names), i)
        engine = LLMEngine(model, tokenizer, cfg, draft_model=draft_model)
        served.append(ServedModel(served_name, engine, adapter=adapter, parent=parent))
    return AsyncEngine(served, select_adapter=select_adapter)


def load_served_models(
    model_name: str,
    loras: dict[str, Path] | None = None,
    config: EngineConfig | None = None,
    *,
    served_model_name: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    chat_template: str | None = None,
    quant: str | None = None,
) -> tuple[AsyncEngine, Any]:
    """Load `model_name` (load_model) and build the AsyncEngine over it. Returns (async engine, tokenizer).
    `chat_template`: a built-in template name (`chatml_tools`) or a .jinja path replacing the checkpoint's.
    `quant`: "int8" for int8 weight-only decode (posttrain/quant/inference.py)."""
    from posttrain.models.hub import load_model
    from posttrain.quant.inference import quantize_for_inference

    model, tokenizer = load_model(model_name, dtype=dtype, device=device, chat_template=chat_template)
    model = quantize_for_inference(model, quant)
    return build_served_models(model, tokenizer, served_model_name or str(model_name), loras, config), tokenizer

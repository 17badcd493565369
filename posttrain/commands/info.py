"""`posttrain info --model M [--json]`: what a model is and what it costs in memory."""

from __future__ import annotations

import argparse
import json

from posttrain.commands.common import add_model_arguments
from posttrain.models.hub import load_model, resolve_model_path
from posttrain.models.transformer import Transformer


def model_info(model: Transformer, source: str) -> dict:
    cfg = model.config
    bytes_per_element = model.dtype.itemsize
    n_params = model.num_parameters()
    return {
        "source": source,
        "architecture": cfg.model_type,
        "parameters": n_params,
        "dtype": str(model.dtype).removeprefix("torch."),
        "weights_bytes": n_params * bytes_per_element,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "attention": "MHA" if cfg.num_key_value_heads == cfg.num_attention_heads
        else ("MQA" if cfg.num_key_value_heads == 1 else "GQA"),
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings,
        "rope": (cfg.rope_scaling or {}).get("rope_type", "default"),
        "rope_theta": cfg.rope_theta,
        "tied_embeddings": cfg.tie_word_embeddings,
        "kv_cache_bytes_per_token": cfg.kv_bytes_per_token(bytes_per_element),
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    path = resolve_model_path(args.model)
    model, _ = load_model(path, dtype=args.dtype, device=args.device or "cpu")
    info = model_info(model, str(path))
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key.endswith("_bytes") or key.endswith("_per_token"):
            value = f"{value} ({_human(value)})"
        elif key == "parameters":
            value = f"{value} ({value / 1e6:.1f}M)"
        print(f"{key:<{width}}  {value}")
    return 0

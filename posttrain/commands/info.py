"""`posttrain info --model M [--json] [--config-only]`: what a model is and what it costs in memory.

With --config-only only config.json is read (no weights), so the figures of a model too large for this
machine, or of a directory holding just its config.json, come out all the same.

`cpu` describes this machine (posttrain.hardware): its fast-bf16 and int8 dot-product features, the measured
matmul rates per dtype (timed once, then cached), and the compute dtype `dtype: auto` picks, with the reason.
"""

from __future__ import annotations

import argparse
import json

from posttrain.commands.common import add_json_argument, add_model_arguments
from posttrain.hardware import report as cpu_report
from posttrain.models.checkpoint_io import parse_dtype, read_hf_config
from posttrain.models.config import ModelConfig
from posttrain.models.hub import load_model, resolve_model_path


def model_info(cfg: ModelConfig, dtype_name: str, bytes_per_element: int, n_params: int, source: str) -> dict:
    info = {
        "source": source,
        "architecture": cfg.model_type,
        "parameters": n_params,
        "dtype": dtype_name,
        "weights_bytes": n_params * bytes_per_element,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "attention": _attention_kind(cfg),
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings,
        "rope": (cfg.rope_scaling or {}).get("rope_type", "default"),
        "rope_theta": cfg.rope_theta,
        "tied_embeddings": cfg.tie_word_embeddings,
        "kv_cache_bytes_per_token": cfg.kv_bytes_per_token(bytes_per_element),
    }
    if cfg.sliding_window is not None:
        sliding = cfg.num_hidden_layers if cfg.layer_types is None else cfg.layer_types.count("sliding_attention")
        info["sliding_window"] = f"{cfg.sliding_window} tokens in {sliding} of {cfg.num_hidden_layers} layers"
    if cfg.mla is not None:
        mla = cfg.mla
        info["kv_lora_rank"] = mla.kv_lora_rank
        info["q_lora_rank"] = mla.q_lora_rank
        info["qk_head_dim"] = f"{mla.qk_nope_head_dim} + {mla.qk_rope_head_dim} rotary"
        info["v_head_dim"] = mla.v_head_dim
        # What the same heads would cache as plain multi-head attention (per-head K and V, expanded).
        info["kv_cache_bytes_per_token_as_mha"] = (
            cfg.num_hidden_layers * cfg.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim) * bytes_per_element
        )
    if cfg.moe is not None:
        moe = cfg.moe
        sparse = sum(moe.is_sparse(i) for i in range(cfg.num_hidden_layers))
        shared = f", shared expert {moe.shared_expert_intermediate_size}" if moe.shared_expert_intermediate_size else ""
        info["experts"] = (
            f"{moe.num_experts_per_tok} of {moe.num_experts} per token ({moe.router}{shared}) in {sparse} layers"
        )
        info["active_parameters"] = n_params - sparse * (moe.num_experts - moe.num_experts_per_tok) * (
            3 * cfg.hidden_size * moe.moe_intermediate_size
        )
    return info


def _attention_kind(cfg: ModelConfig) -> str:
    if cfg.mla is not None:
        return "MLA"
    if cfg.num_key_value_heads == cfg.num_attention_heads:
        return "MHA"
    return "MQA" if cfg.num_key_value_heads == 1 else "GQA"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_json_argument(parser)
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="read config.json only, no weights (dtype from --dtype, else the config's, else float32)",
    )


def run(args: argparse.Namespace) -> int:
    path = resolve_model_path(args.model)
    if args.config_only:
        cfg = read_hf_config(path)
        hf = json.loads((path / "config.json").read_text())
        dtype = parse_dtype(args.dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32")
        n_params = cfg.num_parameters
    else:
        model, _ = load_model(path, dtype=args.dtype, device=args.device or "cpu")
        cfg, dtype, n_params = model.config, model.dtype, model.num_parameters()
    info = model_info(cfg, str(dtype).removeprefix("torch."), dtype.itemsize, n_params, str(path))
    info["cpu"] = cpu_report()
    if args.json:
        print(json.dumps(info))
        return 0
    cpu = {f"cpu.{key}": value for key, value in info.pop("cpu").items()}
    cpu["cpu.flags"] = " ".join(cpu["cpu.flags"]) or "-"
    cpu["cpu.matmul_gflops"] = ", ".join(f"{name} {rate:g}" for name, rate in cpu["cpu.matmul_gflops"].items())
    info.update(cpu)
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key.endswith("_bytes") or "_bytes_per_token" in key:
            value = f"{value} ({_human(value)})"
        elif key.endswith("parameters"):
            value = f"{value} ({value / 1e6:.1f}M)"
        print(f"{key:<{width}}  {value}")
    return 0

"""`posttrain serve`: an OpenAI-compatible HTTP server over the rollout engine (see docs/serve.md)."""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.commands.common import add_model_arguments, add_quant_argument
from posttrain.commands.sampling_args import add_compute_dtype_argument, add_decode_steps_argument
from posttrain.commands.speculative_args import add_speculative_arguments, speculative_config
from posttrain.errors import PosttrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_quant_argument(parser)
    parser.add_argument("--served-model-name", default=None, help="the base model's name in the API (default: --model)")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also serve a PEFT LoRA adapter as model NAME (repeatable)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|PATH",
        help="replace the model's chat template: a built-in name (chatml_tools: tools for the default model) "
        "or a .jinja file",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        metavar="NAME|SPEC",
        help="how tool calls are read from chat replies: hermes, or path/to/file.py:function or "
        "package.module:function (default: hermes)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="0-65535; 0 picks a free port (default: 8000)")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health (repeatable or "
        "comma-separated; default: $POSTTRAIN_API_KEY, else no key)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413 (default: 4 MiB)"
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=None)
    engine.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (split between served models)"
    )
    engine.add_argument("--kv-cache-bytes", type=int, default=None)
    engine.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    engine.add_argument("--no-prefix-caching", action="store_true")
    add_compute_dtype_argument(engine)
    add_decode_steps_argument(engine)
    add_speculative_arguments(parser)


def engine_config(args: argparse.Namespace):
    from posttrain.engine.config import EngineConfig

    fields = {
        name: getattr(args, name)
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_kv_blocks",
            "kv_cache_bytes",
            "kv_cache_memory_fraction",
            "compute_dtype",
            "decode_steps",
        )
        if getattr(args, name) is not None
    }
    if args.no_prefix_caching:
        fields["enable_prefix_caching"] = False
    if args.dtype == "float32":  # fp32 weights asked for by name: fp32 compute too, unless --compute-dtype says
        fields.setdefault("compute_dtype", "float32")
    speculative = speculative_config(args)
    if speculative is not None:
        fields["speculative"] = speculative
    if "max_num_seqs" in fields and "max_num_batched_tokens" not in fields:
        fields["max_num_batched_tokens"] = max(4096, fields["max_num_seqs"])
    return EngineConfig(**fields)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from posttrain.serve.app import build_app
    except ImportError as error:
        raise PosttrainError(f"serve needs FastAPI and uvicorn ({error}): pip install fastapi uvicorn") from None
    from posttrain.chat_templates import load_chat_template
    from posttrain.quant.inference import check_inference_quant
    from posttrain.serve import bind
    from posttrain.serve.auth import ENV_VAR, resolve_api_keys
    from posttrain.serve.loading import load_served_models, parse_lora_specs
    from posttrain.serve.tools import tool_calling

    bind.check_port(args.port)
    if args.max_body_bytes < 1:
        raise PosttrainError(f"--max-body-bytes={args.max_body_bytes}: must be a positive integer")
    api_keys = resolve_api_keys(args.api_key, os.environ)
    loras = parse_lora_specs(args.lora)
    check_inference_quant(args.quant)  # a bad value fails before the model loads
    if args.chat_template is not None:
        load_chat_template(args.chat_template, key="--chat-template")  # a bad name fails before the model loads
    try:
        calling = tool_calling(args.tool_call_parser)
    except PosttrainError as error:
        raise PosttrainError(f"--tool-call-parser: {error}") from None
    sock = bind.bind_socket(args.host, args.port)  # before the model loads: a busy port fails at once
    try:
        port = bind.bound_port(sock)
        if not api_keys and not bind.is_loopback(sock):
            print(
                f"warning: serving on {args.host}:{port} without an API key: anyone who can reach this address "
                f"can use the server; set --api-key or {ENV_VAR}",
                file=sys.stderr,
                flush=True,
            )
        async_engine, tokenizer = load_served_models(
            args.model,
            loras,
            engine_config(args),
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            device=args.device,
            chat_template=args.chat_template,
            quant=args.quant,
        )
        app = build_app(
            async_engine, tokenizer, max_body_bytes=args.max_body_bytes, api_keys=api_keys, tool_calling=calling
        )
        bind.listen(sock, args.host)
        guard = f" ({len(api_keys)} API key{'s' if len(api_keys) > 1 else ''})" if api_keys else ""
        print(f"serving {', '.join(async_engine.models)} on {bind.url(args.host, port)}/v1{guard}", flush=True)
        # log_level warning: no access log (it would show paths and client addresses, never headers).
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
    return 0

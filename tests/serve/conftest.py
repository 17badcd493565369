"""A live server for the serve tests: uvicorn in a background thread on a free loopback port, over a tiny
random model with the default model's real tokenizer, serving the base model and one LoRA adapter."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from posttrain.engine import EngineConfig
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer
from posttrain.tokenizer import Tokenizer

BASE = "tiny"
LORA = "tiny-lora"
MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 256  # per served model


def tiny_model(tokenizer: Tokenizer) -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=tokenizer.vocab_size,
        head_dim=8,
        max_position_embeddings=MAX_MODEL_LEN,
        eos_token_id=sorted(tokenizer.eos_token_ids)[0],
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharper logits than the init: fewer near-ties in greedy decoding
        model.lm_head.weight.mul_(8)
    return model


def make_adapter(tokenizer: Tokenizer, out_dir: Path) -> Path:
    """A PEFT adapter with nonzero B (a fresh adapter would change nothing)."""
    from posttrain.peft import LoraConfig, apply_lora, lora_layers, save_peft_adapter

    model = tiny_model(tokenizer)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for B in layer.lora_B.values():
                B.weight.normal_(0, 0.5)
    return save_peft_adapter(model, out_dir, base_model_name_or_path="tiny")


@dataclass
class LiveServer:
    base_url: str
    tokenizer: Tokenizer
    adapter_dir: Path
    async_engine: object

    @property
    def api(self) -> str:
        return self.base_url + "/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app: object, **uvicorn_options: object) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread on a free loopback port; yields the base URL."""
    import uvicorn

    port = _free_port()
    options = {"log_level": "warning", **uvicorn_options}
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="package")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from posttrain.serve.app import build_app
    from posttrain.serve.loading import build_served_models

    tokenizer = Tokenizer.from_dir(default_model_dir)
    adapter_dir = make_adapter(tokenizer, tmp_path_factory.mktemp("adapter") / "lora")
    config = EngineConfig(num_kv_blocks=2 * NUM_KV_BLOCKS, max_num_seqs=64, max_num_batched_tokens=512)
    async_engine = build_served_models(tiny_model(tokenizer), tokenizer, BASE, {LORA: adapter_dir}, config)
    app = build_app(async_engine, tokenizer, max_body_bytes=64 * 1024)
    with running(app) as base_url:
        yield LiveServer(base_url, tokenizer, adapter_dir, async_engine)

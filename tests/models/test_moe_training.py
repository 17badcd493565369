"""Mixture-of-experts models in training: the router loss reaches the router, and SFT and GRPO run a few
steps on a tiny MoE model with the router metrics in metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from posttrain.config import load_config
from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.config import ModelConfig
from posttrain.models.family_config import MoEConfig
from posttrain.models.moe import add_router_loss, router_loss_and_metrics
from posttrain.models.transformer import Transformer

ROUTER_KEYS = ("router/aux_loss", "router/load_cv", "router/load_max", "router/load_min")


def tiny_moe(vocab_size: int, eos: int = 2, seed: int = 0) -> Transformer:
    """Qwen2-MoE shaped: 2 layers of 4 experts (top 2) and a gated shared expert."""
    moe = MoEConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        shared_expert_gate=True,
        router_aux_loss_coef=0.01,
    )
    cfg = ModelConfig(
        model_type="qwen2_moe",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=1,
        eos_token_id=eos,
        pad_token_id=eos,
        moe=moe,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():  # varied samples (the default init puts most mass on one token)
        model.embed_tokens.weight.mul_(0.2)
    return model


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_router_loss_reaches_the_router_and_skips_padding() -> None:
    model = tiny_moe(64)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    model(ids, attention_mask=mask)
    loss, metrics = add_router_loss(model, torch.zeros(()), mask, num_items=5.0, total_items=10.0)
    loss.backward()
    router = model.layers[1].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    # Metrics come back halved (this micro-batch holds half the step's items), for summing over the step.
    model.zero_grad()
    model(ids, attention_mask=mask)
    _, plain = router_loss_and_metrics(model, mask)
    assert metrics == {k: v * 0.5 for k, v in plain.items()}
    # Padding rows do not count: the masked figures equal those of the real rows alone.
    model(ids[0:1, 4:])
    _, alone = router_loss_and_metrics(model)
    model(ids[0:1], attention_mask=mask[0:1])
    _, masked = router_loss_and_metrics(model, mask[0:1])
    assert all(math.isclose(alone[k], masked[k], rel_tol=1e-5, abs_tol=1e-6) for k in ROUTER_KEYS)


def test_sft_runs_on_a_tiny_moe_and_logs_router_metrics(tmp_path: Path) -> None:
    from posttrain.trainers.sft import SFTConfig, train_sft
    from tests.data.tiny import VOCAB_SIZE, tiny_tokenizer

    tok = tiny_tokenizer()
    model_dir = save_hf_dir(tiny_moe(VOCAB_SIZE), tmp_path / "model", tokenizer=tok)
    data = tmp_path / "qa.jsonl"
    rows = [
        ("What is two plus three?", "Two plus three is five."),
        ("What color is the sky?", "The sky is blue."),
        ("Hello!", "Hello! How can I help you today?"),
        ("What is the answer?", "The answer is 42."),
    ]
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    cfg = load_config(
        SFTConfig,
        overrides=[
            f"model.name_or_path={model_dir}",
            f"data.path={data}",
            "data.columns={prompt: question, completion: answer}",
            "data.as_chat=true",
            f"out={tmp_path / 'run'}",
            "train.progress=false",
            "train.max_steps=3",
            "train.batch_size=2",
            "train.grad_accum=2",
            "data.eval_fraction=0",
            "optim.lr=1e-2",
        ],
    )
    records = [r for r in _metrics(train_sft(cfg)) if "loss" in r]
    assert len(records) == 3
    for record in records:
        assert all(math.isfinite(record[k]) for k in ROUTER_KEYS + ("loss",)), record
        assert record["router/load_min"] <= 1.0 + 1e-6 <= record["router/load_max"] + 2e-6


def test_grpo_runs_on_a_tiny_moe_and_logs_router_metrics(tmp_path: Path) -> None:
    from posttrain.trainers.rl import train_grpo
    from posttrain.trainers.rl.config import GRPOConfig
    from tests.trainers.rl_helpers import rl_overrides, tokenizer

    tok = tokenizer()
    eos = sorted(getattr(tok, "eos_token_ids", []) or [2])[0]
    cfg = load_config(
        GRPOConfig,
        None,
        rl_overrides(tmp_path, "grpo", "train.max_steps=2", "kl.beta=0.05"),
    )
    run_dir = train_grpo(cfg, model=tiny_moe(49152, eos=eos).eval(), tokenizer=tok)
    steps = [r for r in _metrics(run_dir) if "reward/mean" in r]
    assert len(steps) == 2
    for record in steps:
        assert all(math.isfinite(record[k]) for k in ROUTER_KEYS), record

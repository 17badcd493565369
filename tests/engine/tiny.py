"""A tiny random model, a character tokenizer and a small-pool LLM over them, shared by the engine tests."""

from __future__ import annotations

import torch

from posttrain.engine import LLM
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer

VOCAB = 64
EOS = 63


class CharTokenizer:
    """Token i <-> the character chr(48 + i); token 63 is EOS ('<eos>' unless skipped)."""

    eos_token_id = EOS
    eos_token_ids = frozenset({EOS})
    pad_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [(ord(c) - 48) % 63 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if i == EOS and skip_special_tokens else "<eos>" if i == EOS else chr(48 + i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages) + (
            "[assistant]" if add_generation_prompt else ""
        )
        return self.encode(text) if tokenize else text


def tiny_model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharper logits than the init: fewer near-ties, more varied greedy paths
        model.lm_head.weight.mul_(8)
    return model


def make_llm(model: Transformer | None = None, **fields) -> LLM:
    fields = {"block_size": 4, "num_kv_blocks": 128, "max_num_seqs": 16, "max_num_batched_tokens": 24, **fields}
    return LLM(model or tiny_model(), CharTokenizer(), **fields)

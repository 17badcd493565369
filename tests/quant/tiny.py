"""Tiny random models and a character tokenizer for the quantization and eval tests (no transformers
import: each builds in milliseconds)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer
from posttrain.tokenizer import Tokenizer

TINY = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_hf({**TINY, **overrides})).eval()


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character (ids 3..97), <s> = 1 prepended, anything else <unk> = 0."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + i for i, c in enumerate(range(32, 127))}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def write_tiny_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """An fp32 HF model directory with the character tokenizer, as `posttrain convert` writes one."""
    return save_hf_dir(tiny_model(seed, **overrides), path, tokenizer=char_tokenizer())

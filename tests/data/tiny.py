"""A tiny real tokenizer (byte-level BPE trained here, ChatML template) and a tiny random model,
so data and trainer tests run in milliseconds without the default model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer
from posttrain.tokenizer import Tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320

# SmolLM2's template: ChatML with a default system prompt when the chat has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "What is two plus three? Two plus three is five.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The sky is blue. The grass is green. The answer is 42.",
    "You are a helpful assistant. Hello! How can I help you today?",
    "system user assistant tool",
] * 4


def tiny_tokenizer() -> Tokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return Tokenizer(
        backend,
        chat_template=CHATML_TEMPLATE,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


def tiny_model_config(vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_model_config())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.2)
    return model


def save_tiny_model_dir(directory: Path, seed: int = 0) -> Path:
    """An HF directory (weights, config, tokenizer) that load_model and transformers both load."""
    return save_hf_dir(tiny_model(seed), directory, tokenizer=tiny_tokenizer())


# Eight question / answer rows in the corpus's words: the SFT tests' data.
QA = [
    ("What is two plus three?", "Two plus three is five."),
    ("What color is the sky?", "The sky is blue."),
    ("What is the answer?", "The answer is 42."),
    ("Hello!", "Hello! How can I help you today?"),
    ("How many clips did Natalia sell in April?", "Natalia sold 48 clips in April."),
    ("And in May?", "She sold half as many clips in May."),
    ("What color is the grass?", "The grass is green."),
    ("Who are you?", "You are a helpful assistant. I help."),
]


def write_qa_jsonl(path: Path) -> Path:
    """QA as a JSONL file with `question` and `answer` columns."""
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QA))
    return path

"""Tiny random models with the default model's tokenizer, and reward files, for the RL trainer tests."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.models.config import ModelConfig
from posttrain.models.hub import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from posttrain.models.transformer import Transformer

# A reward with spread inside every group: the share of characters of the completion that are digits or
# spaces, so a random model's samples differ and every algorithm has an advantage to follow.
REWARD_SOURCE = """
def char_mix(completions, **kwargs):
    out = []
    for text in completions:
        text = text if isinstance(text, str) else text[0]["content"]
        out.append(sum(c.isdigit() or c == " " for c in text) / max(len(text), 1))
    return out


def parity_gated(completions, answer, **kwargs):
    # zero variance (all 0.0) in every group whose answer is odd: dynamic sampling must drop those
    return [char_mix([c])[0] if int(a) % 2 == 0 else 0.0 for c, a in zip(completions, answer)]


def two_args(p, c):
    return [0.0] * len(c)
"""


def tokenizer():
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


def tiny_model(tok, seed: int = 0, layers: int = 2) -> Transformer:
    """A 2-layer random decoder over the default tokenizer's vocabulary (49152 tokens)."""
    eos = sorted(getattr(tok, "eos_token_ids", []) or [2])
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=eos[0],
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():  # varied samples (the default init puts most mass on one token)
        model.embed_tokens.weight.mul_(0.2)
    return model.eval()


def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards_for_test.py"
    path.write_text(REWARD_SOURCE)
    return path


def rl_overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    """A tiny GRPO / PPO run's dotted overrides: 2 prompts x 4 samples of 6 tokens, the char_mix reward, no
    held-out evaluation, into tmp_path / name; `extra` after them."""
    return [
        f"out={tmp_path / name}",
        f"reward.functions=[{reward_file(tmp_path)}:char_mix]",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_tokens=6",
        "data.eval_size=0",
        "log.progress=false",
        "dapo.overlong_cache_len=4",
        *extra,
    ]

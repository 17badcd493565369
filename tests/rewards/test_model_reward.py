"""RewardModelScorer on a tiny random model with a tiny byte-level tokenizer."""

import math

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers
from torch import nn

from posttrain.errors import CheckpointError
from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer
from posttrain.rewards import (
    RewardError,
    RewardModelScorer,
    RewardSpec,
    compute_rewards,
    load_reward,
    load_score_head,
    save_score_head,
)
from posttrain.rewards.model_reward import encode_for_scoring
from posttrain.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PROMPTS = ["What is 2 plus 2? ", "Hi", "Add 47 and 38. Reply with only the final number. ", "x"]
COMPLETIONS = ["4", "Hello there, how can I help?", "85", ""]


def tiny_tokenizer() -> Tokenizer:
    """Byte-level, no merges: one token per byte, plus the ChatML specials (ids 256, 257)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend, chat_template=CHATML, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def parts():
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=260,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    head = nn.Linear(32, 1)
    return model, tiny_tokenizer(), head


def test_head_is_read_live_and_not_modified(parts):
    model, tokenizer, head = parts
    bf16_head = nn.Linear(32, 1).to(torch.bfloat16)
    scorer = RewardModelScorer(model, tokenizer, bf16_head)
    before = scorer(PROMPTS[:1], COMPLETIONS[:1])[0]
    assert bf16_head.weight.dtype == torch.bfloat16  # the caller's module is left as it was
    with torch.no_grad():
        bf16_head.bias.add_(1.0)  # a training step on the head shows at the next call
    assert scorer(PROMPTS[:1], COMPLETIONS[:1])[0] == pytest.approx(before + 1.0, abs=1e-2)


def test_one_finite_float_per_sample_matching_a_direct_forward(parts):
    model, tokenizer, head = parts
    scores = RewardModelScorer(model, tokenizer, head)(PROMPTS, COMPLETIONS)
    assert len(scores) == len(PROMPTS) and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert len(set(scores)) == len(scores)  # different inputs, different scores
    ids = tokenizer.encode(PROMPTS[2] + COMPLETIONS[2])
    with torch.no_grad():
        expected = head(model.hidden_states(torch.tensor([ids]))[0, -1]).item()
    assert scores[2] == pytest.approx(expected, abs=1e-5)


def test_batching_and_order_do_not_change_scores(parts):
    model, tokenizer, head = parts
    one_by_one = RewardModelScorer(model, tokenizer, head, batch_size=1)(PROMPTS, COMPLETIONS)
    batched = RewardModelScorer(model, tokenizer, head, batch_size=3)(PROMPTS, COMPLETIONS)
    reversed_ = RewardModelScorer(model, tokenizer, head, batch_size=8)(PROMPTS[::-1], COMPLETIONS[::-1])[::-1]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert reversed_ == pytest.approx(one_by_one, abs=1e-5)


def test_conversational_samples_use_the_chat_template(parts):
    model, tokenizer, head = parts
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    scorer = RewardModelScorer(model, tokenizer, head, batch_size=2)
    scores = scorer(prompts, completions)
    assert all(math.isfinite(s) for s in scores)
    ids = encode_for_scoring(tokenizer, prompts[0], completions[0])
    assert ids == tokenizer.apply_chat_template(prompts[0] + completions[0], add_generation_prompt=False)
    assert scores[0] == pytest.approx(scorer.score_ids([ids])[0], abs=1e-5)
    with pytest.raises(TypeError, match="both be strings or both be chat message lists"):
        encode_for_scoring(tokenizer, "plain", completions[0])


def test_long_sequences_keep_their_last_tokens(parts):
    model, tokenizer, head = parts
    scorer = RewardModelScorer(model, tokenizer, head, max_length=6)
    ids = tokenizer.encode(PROMPTS[2] + COMPLETIONS[2])
    assert scorer([PROMPTS[2]], [COMPLETIONS[2]]) == pytest.approx(scorer.score_ids([ids[-6:]]), abs=1e-6)
    assert scorer.score_ids([[]]) == [None]  # nothing to score


def test_saved_reward_model_directory_round_trip(parts, tmp_path):
    model, tokenizer, head = parts
    directory = save_hf_dir(model, tmp_path / "rm", tokenizer=tokenizer)
    save_score_head(head, directory)
    expected = RewardModelScorer(model, tokenizer, head)(PROMPTS, COMPLETIONS)
    assert RewardModelScorer(directory, device="cpu")(PROMPTS, COMPLETIONS) == pytest.approx(expected, abs=1e-5)
    loaded = load_reward(f"reward_model:{directory}", device="cpu", batch_size=2)
    result = compute_rewards([RewardSpec("rm", loaded)], PROMPTS, COMPLETIONS, {"answer": ["4"] * 4})
    assert result.total.tolist() == pytest.approx(expected, abs=1e-5)


def test_score_head_file_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no score.safetensors"):
        load_score_head(tmp_path, 32)
    save_file({"score.weight": torch.zeros(1, 16)}, str(tmp_path / "score.safetensors"))
    with pytest.raises(CheckpointError, match=r"'score.weight' has shape \(1, 16\), the model needs \(1, 32\)"):
        load_score_head(tmp_path, 32)
    save_file({"head.weight": torch.zeros(1, 32)}, str(tmp_path / "score.safetensors"))
    with pytest.raises(CheckpointError, match="expected tensors 'score.weight'.*found head.weight"):
        load_score_head(tmp_path, 32)
    save_score_head(nn.Linear(32, 1, bias=False), tmp_path)
    head = load_score_head(tmp_path, 32)
    assert head.bias is None and head.weight.shape == (1, 32)


def test_constructor_errors(parts):
    model, tokenizer, head = parts
    with pytest.raises(RewardError, match="needs its tokenizer and score_head"):
        RewardModelScorer(model, tokenizer)
    with pytest.raises(RewardError, match=r"score_head must be nn.Linear\(32, 1\)"):
        RewardModelScorer(model, tokenizer, nn.Linear(32, 2))
    with pytest.raises(RewardError, match="device / dtype apply to a directory"):
        RewardModelScorer(model, tokenizer, head, device="cpu")
    with pytest.raises(RewardError, match="expected a reward model directory or a posttrain Transformer"):
        RewardModelScorer(nn.Linear(2, 2), tokenizer, head)

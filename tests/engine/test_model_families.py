"""The engine on the families beyond dense Llama (sliding windows, mixtures of experts, latent attention):
greedy output equals transformers' greedy generate, and sampled logprobs equal the trainer-side dense
forward, with chunked prefill, forks that share prompt blocks, and windows shorter than the sequences."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.models.checkpoint_io import load_hf_dir
from tests.hf_oracle import make_hf_model
from tests.models.sparse_oracle import MLA_FAMILIES, save_sparse_hf_model

# Sliding windows 6-8 tokens; prompts + generations up to 30 tokens.
FAMILIES = ["mistral", "qwen2_swa", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
PROMPTS = [[5, 9, 2, 77, 31], list(range(10, 21)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
MAX_TOKENS = 12


class IdTokenizer:
    """The engine speaks token ids; this is all it asks of a tokenizer here (no EOS: lengths are fixed)."""

    eos_token_id = None
    eos_token_ids = frozenset()
    pad_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":  # the dense-family oracle: window 8
        hf = make_hf_model("mistral")
        with torch.no_grad():
            hf.lm_head.weight.mul_(8)
        hf.save_pretrained(directory)
    else:
        hf = save_sparse_hf_model(request.param, directory, sharpen=8.0)
    return request.param, hf, load_hf_dir(directory).eval()


def _llm(model: torch.nn.Module) -> LLM:
    # Small blocks and a small token budget: prompts are prefilled in chunks across steps.
    return LLM(model, IdTokenizer(), block_size=4, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=12)


def test_greedy_matches_transformers(models) -> None:
    family, hf, ours = models
    llm = _llm(ours)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected, family
    if family in MLA_FAMILIES:  # the cache holds the latent and the rotary key only
        mla = ours.config.mla
        assert ours.kv_cache_shape(7, 4) == (1, 7, 4, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)


def test_sampled_logprobs_equal_dense_forward(models) -> None:
    """n samples fork from one prefill and share its blocks; every sampled token's logprob equals the
    dense forward's over the same tokens (the paged path equals the training path)."""
    _, _, ours = models
    llm = _llm(ours)
    outs = llm.generate(
        PROMPTS[1:], SamplingParams(n=3, temperature=0.8, max_tokens=10, ignore_eos=True, seed=3, logprobs=True)
    )
    for prompt, out in zip(PROMPTS[1:], outs):
        for sample in out.outputs:
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = ours(ids)[0, len(prompt) - 1 : -1] / 0.8  # (T, V)
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)

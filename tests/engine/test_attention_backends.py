"""EngineConfig.attention_backend: what `auto` picks, what each backend refuses, and the engine's outputs with
the FlexAttention and reference kernels on CPU equal to its default path's (the C / cascade kernels)."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.engine.attention_backend import resolve_attention_backend
from posttrain.engine.config import EngineConfig, EngineConfigError
from posttrain.errors import PosttrainError
from posttrain.models.checkpoint_io import load_hf_dir
from tests.engine.test_engine import PROMPTS, dense_greedy, dense_logprobs
from tests.engine.test_model_families import IdTokenizer
from tests.engine.tiny import make_llm, tiny_model
from tests.hf_oracle import make_hf_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_keeps_the_cpu_path_on_cpu() -> None:
    assert resolve_attention_backend("auto", CPU, torch.float32, 16) == "cpu"
    assert make_llm().engine.runner.attention_backend == "cpu"
    assert resolve_attention_backend("auto", torch.device("mps"), torch.float16, 16) == "reference"


def test_auto_on_cuda_takes_flash_only_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.models import paged_flash

    monkeypatch.setattr(paged_flash, "available", lambda: False)
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 256) == "flex"
    monkeypatch.setattr(paged_flash, "available", lambda: True)
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 256) == "flash"
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 16) == "flex"  # flash-attn 2: blocks of 256k
    assert resolve_attention_backend("auto", CUDA, torch.float32, 256) == "flex"  # flash-attn: half types only


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "block_size", "reason"),
    [
        ("cpu", CUDA, torch.bfloat16, 16, "the model is on cuda"),
        ("flash", CPU, torch.float32, 256, "CUDA only"),
        ("flex", CUDA, torch.bfloat16, 8, "multiple of 16"),
    ],
)
def test_a_backend_that_cannot_run_says_why(backend, device, dtype, block_size, reason) -> None:
    with pytest.raises(PosttrainError, match=reason):
        resolve_attention_backend(backend, device, dtype, block_size)


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(EngineConfigError, match="attention_backend='triton'"):
        EngineConfig(attention_backend="triton")


@pytest.mark.parametrize("backend", ["flex", "reference"])
def test_outputs_equal_the_default_path(backend: str) -> None:
    """Greedy tokens equal the dense loop's, and sampled logprobs the trainer's forward, with chunked prefill,
    forks sharing prompt blocks and the prefix cache, as on the default CPU path (tests/engine/test_engine.py)."""
    model = tiny_model()
    # On CPU FlexAttention runs unfused over the whole pool (0.1 s a call here): a small pool, short outputs.
    llm = make_llm(model, attention_backend=backend, num_kv_blocks=48)
    assert llm.engine.runner.attention_backend == backend
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in greedy] == [dense_greedy(model, p, 8) for p in PROMPTS]
    sampled = llm.generate(PROMPTS[2:4], SamplingParams(n=3, temperature=0.7, max_tokens=6, logprobs=True, seed=11))
    for prompt, out in zip(PROMPTS[2:4], sampled):
        for sample in out.outputs:
            expected = dense_logprobs(model, prompt, sample.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0  # the second generate reused the first's blocks
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_flex_with_sliding_windows_equals_the_default_path(tmp_path) -> None:
    """Mistral's window (8) shorter than the sequences: every layer windowed, in FlexAttention's mask."""
    hf = make_hf_model("mistral")
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path).eval()
    prompts = [[5, 9, 2, 77, 31], list(range(10, 21)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    fields = dict(block_size=4, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=12)
    outs = {}
    for backend in ("cpu", "flex"):
        llm = LLM(model, IdTokenizer(), attention_backend=backend, **fields)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["flex"] == outs["cpu"]

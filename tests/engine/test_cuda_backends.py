"""The GPU side of the engine, run by benchmarks/gpu_check.sh on a CUDA machine (skipped elsewhere): dense logits
against transformers in bf16, each paged-attention backend's kernel against the reference on CUDA (compiled
FlexAttention visits only its BlockMask's blocks there), and the engine's outputs with each backend, with and
without CUDA graphs, including the sliding-window and latent-attention layers."""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.models import paged_flash
from posttrain.models.attention import PagedAttentionMetadata
from posttrain.models.checkpoint_io import load_hf_dir
from posttrain.models.paged_attention import paged_attention
from tests.engine.test_model_families import IdTokenizer
from tests.hf_oracle import FAMILIES, make_hf_model
from tests.models.sparse_oracle import save_sparse_hf_model
from tests.numeric import assert_reordered, bf16_rtol, reorder_rtol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")
# Per layer: RMSNorm, q/k/v, rotary, scores, softmax, weights x values, o_proj, residual, RMSNorm, gate/up,
# silu * up, down, residual (13); 2 layers, the final norm and the LM head: 28 roundings on either side.
LOGITS_RTOL = bf16_rtol(28)
# One attention call: q.k, the softmax's exponentials and normaliser, weights x values, the output's cast.
ATTENTION_BF16_RTOL = bf16_rtol(5)
KERNEL_BACKENDS = ["flex"] + (["flash"] if paged_flash.available() else [])


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"dynamic_rope"}))  # dynamic NTK: HF keeps state
def test_dense_logits_match_transformers_in_bf16(family: str, tmp_path) -> None:
    hf = make_hf_model(family)
    hf.save_pretrained(tmp_path)
    hf = hf.to(CUDA, torch.bfloat16)
    ours = load_hf_dir(tmp_path, dtype=torch.bfloat16, device=CUDA).eval()
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.no_grad():
        expected, got = hf(ids).logits.float(), ours(ids).float()
    assert_reordered(got, expected, LOGITS_RTOL, msg=family)


def _cuda_step(seed: int, block_size: int, decode_only: bool, heads: int = 8, hkv: int = 2, d: int = 64):
    """Groups of samples sharing prompt blocks (one 'system' block shared by all), own blocks after them,
    decode and prefill rows; a pool of 64 blocks on CUDA."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    free = list(range(1, 64))
    rng.shuffle(free)
    system = free.pop()
    tables, ctx, qlens = [], [], []
    for group in range(6):
        prompt = [system] + [free.pop() for _ in range(rng.randint(0, 2))]
        for _ in range(rng.randint(1, 3)):
            table = prompt + [free.pop() for _ in range(rng.randint(1, 2))]
            length = (len(table) - 1) * block_size + rng.randint(1, block_size)
            tables.append(table)
            ctx.append(length)
            qlens.append(1 if decode_only or group % 2 else min(length, rng.randint(2, 40)))
    width = max(len(t) for t in tables)
    slots = [
        t[p // block_size] * block_size + p % block_size for t, c, n in zip(tables, ctx, qlens) for p in range(c - n, c)
    ]
    N = len(slots)
    q, k, v = (torch.randn(N, h, d, device=CUDA) for h in (heads, hkv, hkv))
    cache = torch.randn(2, 64, block_size, hkv, d, device=CUDA)
    as_cuda = lambda values: torch.tensor(values, device=CUDA)  # noqa: E731
    fields = (
        as_cuda(slots),
        as_cuda([t + [0] * (width - len(t)) for t in tables]),
        as_cuda(ctx),
        as_cuda(qlens),
        max(qlens),
    )
    return q, k, v, cache, fields


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_matches_reference_on_cuda(backend: str, dtype: torch.dtype, decode_only: bool, window) -> None:
    if backend == "flash" and dtype == torch.float32:
        pytest.skip("flash-attn takes half types only")
    block_size = 256 if backend == "flash" else 16
    q, k, v, cache, fields = _cuda_step(0, block_size, decode_only)
    q, k, v, cache = q.to(dtype), k.to(dtype), v.to(dtype), cache.to(dtype)
    outs = {}
    for name in ("reference", backend):
        meta = PagedAttentionMetadata([cache.clone()], *fields, backend=name)
        outs[name] = paged_attention(q, k, v, meta, 0, window).float()
    rtol = reorder_rtol(4, 64 * block_size) if dtype == torch.float32 else ATTENTION_BF16_RTOL
    assert_reordered(outs[backend], outs["reference"], rtol)


PROMPTS = [[5, 9, 2, 77, 31], list(range(10, 21)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2] * 2]


def _engine_outputs(model, backend: str, graphs: bool, block_size: int):
    llm = LLM(
        model,
        IdTokenizer(),
        block_size=block_size,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        attention_backend=backend,
        cuda_graphs=graphs,
    )
    assert llm.engine.attention_backend == backend
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    sampled = llm.generate(
        PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=16, ignore_eos=True, seed=5, logprobs=True)
    )
    return [o.outputs[0].token_ids for o in greedy], sampled


@pytest.mark.parametrize("family", ["llama", "mistral", "deepseek_v2"])  # plain, sliding window, latent attention
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("backend", ["flex", "reference"] + (["flash"] if paged_flash.available() else []))
def test_engine_outputs_on_cuda(family: str, graphs: bool, backend: str, tmp_path) -> None:
    """fp32 on CUDA: greedy tokens equal the dense greedy loop's, sampled logprobs the dense forward's."""
    if backend == "flash":
        pytest.skip("flash-attn takes half types only; its kernel is checked in bf16 above")
    if family == "deepseek_v2" and graphs:
        pytest.skip("a mixture-of-experts model: the engine refuses CUDA graphs (routing syncs)")
    if family == "deepseek_v2":
        save_sparse_hf_model(family, tmp_path, sharpen=8.0)
    else:
        hf = make_hf_model(family)
        with torch.no_grad():
            hf.lm_head.weight.mul_(8)
        hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path, dtype=torch.float32, device=CUDA).eval()
    greedy, sampled = _engine_outputs(model, backend, graphs, block_size=16)
    for prompt, tokens in zip(PROMPTS, greedy):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(model(torch.tensor([ids], device=CUDA))[0, -1].argmax()))
        assert tokens == ids[len(prompt) :], (family, backend, graphs)
    for prompt, out in zip(PROMPTS, sampled):
        for sample in out.outputs:
            ids = torch.tensor([prompt + sample.token_ids], device=CUDA)
            with torch.no_grad():
                logits = model(ids)[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.token_ids, device=CUDA)[:, None])
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected[:, 0].cpu(), atol=1e-4, rtol=0)

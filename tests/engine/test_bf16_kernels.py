"""The C decode attention and K/V writes over a bf16 KV pool (the engine's compute_dtype=bfloat16).

Two oracles. The kernel reads each bf16 element widened to fp32, which is exact, and computes in fp32: so on the
widened pool the fp32 PyTorch reference must agree with it to fp32 rounding (the same tolerance as the fp32 kernel
test). Against the unrounded fp32 pool it may differ by what rounding K and V to bf16 does, bounded below.
"""

from __future__ import annotations

import random

import pytest
import torch

from posttrain import kernels
from posttrain.models.paged_attention import paged_attention, reference_paged_attention
from tests.engine.test_cpu_kernels import _decode_step, _with_cache

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="no C compiler with OpenMP here")

BF16_ROUNDOFF = 2.0**-9  # bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-9 of it


def bf16_pool_bound(q: torch.Tensor, cache: torch.Tensor, scale: float) -> float:
    """The most rounding K and V to bf16 can move an attention output, to first order. A score s_t = scale q.k_t
    moves by at most du = u * scale * sum_d |q_d k_td|; softmax weights then move by at most 2 p_t max du (each
    weight's own score and the normaliser's shift), and sum_t p_t v_t by 2 max du * max|v| through the weights plus
    u * max|v| through the rounded values. Taken over every query head against every cached key (q (N, H, D), cache
    (2, blocks, bs, Hkv, D)): looser than any one row needs, still far below what a misread pool gives (outputs off
    by the size of the values)."""
    keys = cache[0].reshape(-1, cache.shape[-1]).abs()  # (slots * Hkv, D)
    score_moves = BF16_ROUNDOFF * scale * (q.reshape(-1, q.shape[-1]).abs() @ keys.T).max()
    largest_value = cache[1].abs().max()
    return float((2 * score_moves + BF16_ROUNDOFF) * largest_value)


@needs_kernels
# SmolLM2's shapes; 32-token blocks (two 16-score vectors a block on AVX-512); the 8-lane path (72 = 64 + 8, 8)
@pytest.mark.parametrize("bs, hkv, heads_per_kv, D", [(16, 3, 3, 64), (32, 2, 2, 32), (8, 1, 4, 72), (4, 2, 3, 8)])
def test_bf16_pool_decode_matches_the_fp32_reference(bs: int, hkv: int, heads_per_kv: int, D: int, kernel_march: str):
    rng = random.Random(bs + D)
    torch.manual_seed(D)
    groups = [(5, 2 * bs + 3), (1, bs), (3, bs - 1), (8, 3 * bs)]  # cascade groups, a lone sequence, no sharing
    q, k, v, meta = _decode_step(rng, bs, hkv, heads_per_kv, D, groups)
    fp32_cache = meta.kv_caches[0]
    pool = fp32_cache.to(torch.bfloat16)
    bf16_meta = _with_cache(meta, pool)
    assert kernels.supports(q, pool)
    out = paged_attention(q, k, v, bf16_meta, 0)  # the C path: writes k, v rounded, then reads the bf16 pool
    assert out.dtype == torch.float32

    # On the widened pool (k, v rounded as the write rounds them): the same computation, to fp32 rounding.
    widened = _with_cache(meta, pool.float())
    k16, v16 = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    expected = reference_paged_attention(q, k16, v16, _with_cache(meta, fp32_cache.to(torch.bfloat16).float()), 0)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    reference_paged_attention(q, k16, v16, widened, 0)  # the reference's own writes, into the widened pool
    assert torch.equal(pool.float(), widened.kv_caches[0])  # the C writes: the bf16 rounding of k, v, in place

    # Against the unrounded fp32 pool: within what the bf16 rounding of K and V can do.
    exact = reference_paged_attention(q, k, v, _with_cache(meta, fp32_cache.clone()), 0)
    bound = bf16_pool_bound(q, fp32_cache, D**-0.5)
    error = (out - exact).abs().max().item()
    assert error <= bound, (error, bound)
    assert error > 0  # the pool really was bf16


@needs_kernels
def test_bf16_write_kv_rounds_like_torch_and_skips_negative_slots(kernel_march: str):
    torch.manual_seed(0)
    pool = torch.randn(2, 10, 4, 2, 8).to(torch.bfloat16)
    expected = pool.clone()
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, -1, 33])
    kernels.write_kv(pool, k, v, slots)
    flat = expected.view(2, -1, 2, 8)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = k[i].to(torch.bfloat16), v[i].to(torch.bfloat16)
    assert torch.equal(pool, expected)


def test_the_pytorch_path_takes_a_bf16_pool_too(monkeypatch: pytest.MonkeyPatch):
    """cpu_kernels=False (or no compiler): the PyTorch decode and prefill paths over the same bf16 pool agree
    with the reference on the widened pool."""
    monkeypatch.setattr(kernels, "supports", lambda q, cache: False)
    rng = random.Random(3)
    torch.manual_seed(3)
    q, k, v, meta = _decode_step(rng, 4, 2, 3, 8, [(4, 9), (1, 4)], num_blocks=120)
    pool = meta.kv_caches[0].to(torch.bfloat16)
    widened = pool.float()
    out = paged_attention(q, k, v, _with_cache(meta, pool), 0)
    expected = reference_paged_attention(
        q, k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), _with_cache(meta, widened), 0
    )
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)

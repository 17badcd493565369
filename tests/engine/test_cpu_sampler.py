"""The sampler's one-pass draw in C (posttrain/kernels/sampler.c) against the PyTorch draw it
stands in for: softmax, then `sample_from_weights` with the same uniforms."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain import kernels
from posttrain.engine import sampler
from posttrain.engine.sampler import SamplingRow, sample
from posttrain.engine.sampling_params import SamplingParams
from tests.numeric import serial_sum_rtol

# Every test against the kernels built for each instruction set (tests/engine/conftest.py).
pytestmark = [
    pytest.mark.skipif(kernels.library() is None, reason="no C compiler with OpenMP here"),
    pytest.mark.usefixtures("kernel_march"),
]

BLOCK = sampler.SUM_BLOCK


@pytest.mark.parametrize("vocab", [7, 1024, 2500, 49152])  # under one block, one, a short tail, SmolLM2's
def test_same_draw_and_logprobs_as_pytorch(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(256, vocab, generator=generator) * 3
    uniforms = torch.rand(256, dtype=torch.float64, generator=generator)
    tokens, logprobs = kernels.sample_rows(logits, uniforms, BLOCK)
    # Both sum their weights in fp32, each in its own order: a drawn token may differ only where the uniform
    # falls within rounding of a step of the CDF. So each draw is checked against the exact (fp64) CDF: the
    # uniform lies in the drawn token's step, widened by the worst case of the kernel's fp32 sum of a block of
    # positive weights (whose roundings do not average out) and its exp's few ulp, on a CDF of at most 1.
    reference = torch.log_softmax(logits.double(), -1)  # (rows, vocab)
    weights = reference.exp()
    upper = weights.cumsum(-1).gather(1, tokens[:, None]).squeeze(1)  # CDF at the drawn token
    lower = upper - weights.gather(1, tokens[:, None]).squeeze(1)
    slack = serial_sum_rtol(BLOCK + 4)
    assert ((uniforms >= lower - slack) & (uniforms <= upper + slack)).all()
    # The logprob, logit - max - log(sum): the sum's relative error as above, and a few roundings of the logit.
    drawn = reference.gather(1, tokens[:, None]).squeeze(1)
    bound = slack + serial_sum_rtol(4) * max(1.0, drawn.abs().max().item())
    assert (logprobs.double() - drawn).abs().max().item() <= bound


def test_masked_tokens_are_never_drawn_even_at_the_edges_of_the_unit_interval() -> None:
    logits = torch.full((4, 3000), float("-inf"))
    kept = [5, 1100, 2999]  # in the first, second and the short last block
    logits[:, kept] = torch.tensor([0.5, 2.0, -1.0])
    uniforms = torch.tensor([0.0, 0.5, 1.0 - 2**-53, 0.999999], dtype=torch.float64)
    tokens, logprobs = kernels.sample_rows(logits, uniforms, BLOCK)
    assert tokens.tolist()[0] == 5 and tokens.tolist()[2] == 2999
    assert set(tokens.tolist()) <= set(kept)
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert (logprobs - expected).abs().max().item() < 1e-6


def test_a_token_38_orders_below_the_top_is_never_drawn() -> None:
    logits = torch.tensor([[0.0, -90.0, -1e30]])
    for u in (0.0, 0.5, 1.0 - 2**-53):
        tokens, _ = kernels.sample_rows(logits, torch.tensor([u], dtype=torch.float64), BLOCK)
        assert tokens.item() == 0


def test_frequencies_follow_the_softmax() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.0, 3.0, float("-inf"), 0.5]])
    draws = 20_000
    uniforms = torch.rand(draws, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tokens, _ = kernels.sample_rows(logits.expand(draws, -1), uniforms, BLOCK)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits[0].double(), -1) * draws
    assert counts[4] == 0
    support = expected > 0
    chi_square = (((counts - expected) ** 2)[support] / expected[support]).sum().item()
    assert chi_square < 4 + 6 * math.sqrt(8) + 10  # far above the 99.99th percentile at 4 degrees


def _rows(params: SamplingParams, count: int, seed: int) -> list[SamplingRow]:
    return [SamplingRow(params, [1, 2], [], sampler.make_generator(seed + i), {0}) for i in range(count)]


def test_sample_takes_it_only_for_unfiltered_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = kernels.sample_rows
    monkeypatch.setattr(kernels, "sample_rows", lambda *a: calls.append(1) or original(*a))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sample(logits, _rows(SamplingParams(temperature=0.7, logprobs=2), 3, 0))
    assert len(calls) == 1
    for params in (
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=0),
    ):
        sample(logits, _rows(params, 3, 0))
    assert len(calls) == 1  # filters and greedy rows take the PyTorch path


def test_sample_gives_the_same_tokens_with_and_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.8, logprobs=1, frequency_penalty=0.5)
    fast = sample(logits, _rows(params, 64, 10))
    monkeypatch.setattr(kernels, "samples_on_cpu", lambda logits: False)
    slow = sample(logits, _rows(params, 64, 10))
    assert torch.equal(fast.token_ids, slow.token_ids)
    # Each path's own sum over the vocabulary (worst case, as above) and a few roundings of the logit.
    bound = 2 * serial_sum_rtol(BLOCK + 4) + serial_sum_rtol(4) * max(1.0, slow.logprobs.abs().max().item())
    assert (fast.logprobs - slow.logprobs).abs().max().item() <= bound
    assert fast.top_logprobs == slow.top_logprobs

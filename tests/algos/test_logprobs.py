"""Chunked log-probs, entropy and cross-entropy: equal to the dense formulas, values and gradients,
while keeping far fewer bytes alive for backward (counted with saved_tensors_hooks)."""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from posttrain.algos.logprobs import chunked_cross_entropy, entropy_from_logits, token_logprobs


def saved_bytes(fn: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run fn and count the bytes autograd saves for backward, except storage shared with `inputs`
    (saving a reference to the caller's own tensor costs nothing extra)."""
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in input_storages:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def _logits(batch: int, time: int, vocab: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(batch, time, vocab, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 3


@pytest.mark.parametrize("chunk_tokens", [4, 16, 1000])  # pieces of a row / whole rows / everything
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_log_softmax_gather(chunk_tokens: int, temperature: float) -> None:
    full = _logits(3, 11, 50)
    logits = full[:, :-1].clone().requires_grad_()  # (3, 10, 50)
    labels = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(1))
    labels[0, 7:] = -100
    ours = token_logprobs(logits, labels, temperature, chunk_tokens=chunk_tokens)

    ref_logits = logits.detach().clone().requires_grad_()
    valid = labels != -100
    ref = torch.log_softmax(ref_logits / temperature, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    ref = ref * valid

    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)
    upstream = torch.randn(3, 10, dtype=torch.float64)
    ours.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-10, rtol=1e-10)
    assert (logits.grad[0, 7:] == 0).all()


def test_token_logprobs_on_a_non_contiguous_view_and_bf16() -> None:
    full = _logits(2, 9, 40, dtype=torch.float32).bfloat16().requires_grad_()
    view = full[:, :-1]  # not viewable as (B*T, V): must not be copied
    labels = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    ours, extra = saved_bytes(lambda: token_logprobs(view, labels, chunk_tokens=4), full)
    assert extra < view.numel() * view.element_size() / 5  # the view itself is saved, not a copy of it
    assert ours.dtype == torch.float32  # bf16 logits are worked on in float32
    ref = torch.log_softmax(view.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_token_logprobs_keep_no_second_vocab_sized_copy() -> None:
    batch, time, vocab = 4, 32, 512
    logits = _logits(batch, time, vocab, dtype=torch.float32).requires_grad_()
    labels = torch.randint(0, vocab, (batch, time))
    full_copy = batch * time * vocab * 4

    _, ours = saved_bytes(lambda: token_logprobs(logits, labels, chunk_tokens=16), logits)
    _, dense = saved_bytes(lambda: torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1), logits)
    assert dense >= full_copy  # the dense path keeps the whole log-softmax
    assert ours < full_copy / 20  # ours: logsumexp + labels, (B, T) each

    _, ours_entropy = saved_bytes(lambda: entropy_from_logits(logits, chunk_tokens=16), logits)
    _, dense_entropy = saved_bytes(lambda: -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1), logits)
    assert dense_entropy >= full_copy
    assert ours_entropy < full_copy / 20


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_entropy_matches_dense_formula_and_gradient(temperature: float) -> None:
    logits = _logits(2, 6, 30, seed=3).requires_grad_()
    ours = entropy_from_logits(logits, temperature=temperature, chunk_tokens=5)
    ref_logits = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(ref_logits / temperature, -1)
    ref = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)
    upstream = torch.randn(2, 6, dtype=torch.float64)
    ours.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-10, rtol=1e-10)


def test_entropy_of_uniform_is_log_vocab() -> None:
    out = entropy_from_logits(torch.zeros(1, 3, 64))
    torch.testing.assert_close(out, torch.full((1, 3), float(torch.log(torch.tensor(64.0)))))


def _ce_inputs(n: int = 37, d: int = 16, vocab: int = 101, seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [8, 37, 64])
def test_chunked_cross_entropy_matches_f_cross_entropy(reduction: str, chunk: int) -> None:
    hidden, weight, labels = _ce_inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = chunked_cross_entropy(h, w, labels, chunk=chunk, reduction=reduction)
    ours.backward()

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.T, labels, reduction=reduction)
    ref.backward()

    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-5, rtol=1e-5)


def test_chunked_cross_entropy_with_frozen_head() -> None:
    hidden, weight, labels = _ce_inputs()
    h = hidden.clone().requires_grad_()
    chunked_cross_entropy(h, weight, labels, chunk=8).backward()
    h_ref = hidden.clone().requires_grad_()
    F.cross_entropy(h_ref @ weight.T, labels).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)


def test_chunked_cross_entropy_saves_no_logits() -> None:
    n, d, vocab = 256, 32, 2048
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, d, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    logits_bytes = n * vocab * 4

    _, ours = saved_bytes(lambda: chunked_cross_entropy(hidden, weight, labels, chunk=32), hidden, weight)
    _, dense = saved_bytes(lambda: F.cross_entropy(hidden @ weight.T, labels), hidden, weight)
    assert dense >= logits_bytes  # full (N, V) log-softmax kept for backward
    assert ours < logits_bytes / 50  # only (N,) vectors: labels, mask, logsumexp

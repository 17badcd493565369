"""Per-token quantities from logits, computed in chunks so that no second (B, T, V) tensor exists.

Why custom autograd Functions: `log_softmax(logits).gather(labels)` keeps the whole (B, T, V)
log-softmax alive for backward, a second copy of the largest activation in LLM training (for
V = 150k, B*T = 16k tokens that is ~10 GB in fp32). Here the forward keeps only the logsumexp per
token (B, T) and the backward recomputes softmax one chunk at a time, writing straight into the
gradient buffer. `chunked_cross_entropy` goes one step further and never builds the (N, V) logits
at all: it multiplies hidden states by the LM-head weight one row chunk at a time, forward and
backward (the idea of Liger's fused linear cross-entropy, with recompute instead of stored grads).

Work is done in float32 for half-precision inputs (a bf16 logsumexp over 150k entries is too lossy)
and in the input dtype otherwise (float64 stays float64); outputs have that working dtype.
"""

from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor

DEFAULT_CHUNK_TOKENS = 256  # (256, V=150k) fp32 scratch is ~150 MB


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16 / fp16 / fp32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _scaled(logits: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """logits / temperature in `dtype`: at T = 1 in the working dtype, the caller's view itself (no
    (b, t, V) copy; the callers only read it)."""
    if temperature == 1.0 and logits.dtype == dtype:
        return logits
    return logits.to(dtype) / temperature


def _chunks(batch: int, time: int, chunk_tokens: int) -> Iterator[tuple[slice, slice]]:
    """Cover the (batch, time) grid with blocks of about chunk_tokens tokens.

    Basic slicing only, so every block of a (B, T, V) tensor is a view even when the tensor itself
    is a non-contiguous view such as `logits[:, :-1]`: no hidden copy.
    """
    if time == 0 or batch == 0:
        return
    if chunk_tokens >= time:  # whole sequences, several at a time
        rows = chunk_tokens // time
        for b in range(0, batch, rows):
            yield slice(b, b + rows), slice(0, time)
    else:  # pieces of one sequence
        for b in range(batch):
            for t in range(0, time, chunk_tokens):
                yield slice(b, b + 1), slice(t, t + chunk_tokens)


def _per_token_with_lse(
    logits: Tensor, temperature: float, chunk_tokens: int, per_chunk: Callable[[Tensor, Tensor, slice, slice], Tensor]
) -> tuple[Tensor, Tensor]:
    """One forward pass over logits (B, T, V) in chunks: z = logits / temperature in the working dtype and its
    logsumexp per token; `per_chunk(z (b, t, V), lse (b, t), bs, ts)` gives the chunk's values (b, t).
    Returns (values (B, T), logsumexp (B, T)), both in the working dtype; the backward needs only the latter."""
    batch, time, _ = logits.shape
    work = _work_dtype(logits.dtype)
    values = logits.new_empty((batch, time), dtype=work)  # (B, T)
    lse = torch.empty_like(values)  # (B, T)
    for bs, ts in _chunks(batch, time, chunk_tokens):
        z = _scaled(logits[bs, ts], work, temperature)  # (b, t, V)
        lse_c = torch.logsumexp(z, dim=-1)  # (b, t)
        values[bs, ts] = per_chunk(z, lse_c, bs, ts)
        lse[bs, ts] = lse_c
    return values, lse


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z / tau)[label] per token; saves only the logsumexp (B, T) besides the input."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, temperature: float, chunk_tokens: int) -> Tensor:
        def logprob(z: Tensor, lse_c: Tensor, bs: slice, ts: slice) -> Tensor:
            return z.gather(-1, labels[bs, ts].unsqueeze(-1)).squeeze(-1) - lse_c  # (b, t)

        logprobs, lse = _per_token_with_lse(logits, temperature, chunk_tokens, logprob)  # (B, T), (B, T)
        ctx.save_for_backward(logits, labels, lse)  # logits is the caller's tensor, not a copy
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, labels, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for bs, ts in _chunks(logits.shape[0], logits.shape[1], ctx.chunk_tokens):
            z = _scaled(logits[bs, ts], lse.dtype, tau)  # (b, t, V)
            g = grad_out[bs, ts].unsqueeze(-1)  # (b, t, 1)
            # d/dz (z_y - lse(z)) = onehot(y) - softmax(z); chain rule through z = logits / tau
            dz = torch.exp(z - lse[bs, ts].unsqueeze(-1)).mul_(-g)  # (b, t, V)
            dz.scatter_add_(-1, labels[bs, ts].unsqueeze(-1), g)
            grad[bs, ts] = dz if tau == 1.0 else dz.div_(tau)
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H(softmax(z / tau)) per token; saves only the logsumexp (B, T) besides the input."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, temperature: float, chunk_tokens: int) -> Tensor:
        def entropy_of(z: Tensor, lse_c: Tensor, bs: slice, ts: slice) -> Tensor:
            probs = torch.exp(z - lse_c.unsqueeze(-1))  # (b, t, V)
            return lse_c - (probs * z).sum(dim=-1)  # H = lse - E_p[z]

        entropy, lse = _per_token_with_lse(logits, temperature, chunk_tokens, entropy_of)  # (B, T), (B, T)
        ctx.save_for_backward(logits, lse)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None]:
        logits, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (B, T, V)
        for bs, ts in _chunks(logits.shape[0], logits.shape[1], ctx.chunk_tokens):
            z = logits[bs, ts].to(lse.dtype) / tau  # (b, t, V)
            probs = torch.exp(z - lse[bs, ts].unsqueeze(-1))  # (b, t, V)
            mean_z = (probs * z).sum(dim=-1, keepdim=True)  # (b, t, 1)
            # dH/dz_k = -p_k (z_k - E_p[z])
            dz = probs.mul_(z.sub_(mean_z)).mul_(-grad_out[bs, ts].unsqueeze(-1) / tau)
            grad[bs, ts] = dz
        return grad, None, None


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """log softmax(logits / temperature)[labels] per token, memory-lean.

    Same value as `log_softmax(logits / T, -1).gather(-1, labels)` (TRL's `selective_log_softmax`
    after its `logits / temperature`), but forward and backward work on chunks of `chunk_tokens`
    tokens and nothing of size (B, T, V) is kept for backward except `logits` itself. Positions whose
    label is `ignore_index` get logprob 0 and no gradient.

    logits: (B, T, V), any float dtype, may be a non-contiguous view; labels: (B, T) int.
    Returns (B, T) in float32 (float64 for float64 logits).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"logits (B, T, V) and labels (B, T) disagree: {tuple(logits.shape)} vs {tuple(labels.shape)}")
    valid = labels != ignore_index  # (B, T)
    safe_labels = labels.masked_fill(~valid, 0).long()  # (B, T)
    logprobs = _TokenLogprobs.apply(logits, safe_labels, float(temperature), chunk_tokens)  # (B, T)
    return logprobs * valid


def entropy_from_logits(
    logits: Tensor, *, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Tensor:
    """Entropy of softmax(logits / temperature) per token: H = logsumexp(z) - sum_k p_k z_k.

    The formula of verl's `entropy_from_logits` and TRL's `entropy_from_logits`; chunked like
    `token_logprobs`, and differentiable (for an entropy bonus) with the same memory bound.

    logits: (B, T, V). Returns (B, T) in float32 (float64 for float64 logits).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    return _Entropy.apply(logits, float(temperature), chunk_tokens)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (hidden @ weight.T) without the (N, V) logits: recompute per chunk."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, valid: Tensor, chunk: int, mean: bool
    ) -> Tensor:
        work = _work_dtype(hidden.dtype)
        lse = hidden.new_empty(hidden.shape[0], dtype=work)  # (N,)
        total = hidden.new_zeros((), dtype=work)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s : s + chunk] @ weight.T).to(work)  # (c, V): the only V-wide buffer
            lse_c = torch.logsumexp(logits, dim=-1)  # (c,)
            target = logits.gather(1, labels[s : s + chunk, None]).squeeze(1)  # (c,)
            total += ((lse_c - target) * valid[s : s + chunk]).sum()
            lse[s : s + chunk] = lse_c
        n_valid = valid.sum()
        ctx.save_for_backward(hidden, weight, labels, valid, lse)
        ctx.chunk, ctx.divisor = chunk, (n_valid if mean else None)
        return total / n_valid if mean else total

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, labels, valid, lse = ctx.saved_tensors
        work = lse.dtype
        scale = grad_loss.to(work) if ctx.divisor is None else grad_loss.to(work) / ctx.divisor
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None  # (N, d)
        grad_weight = torch.zeros(weight.shape, dtype=work, device=weight.device) if need_weight else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]  # (c, d)
            logits = (h @ weight.T).to(work)  # (c, V)
            # d loss_row / d logits = softmax(logits) - onehot(label), zero for ignored rows
            g = torch.exp(logits.sub_(lse[s : s + ctx.chunk, None]))  # (c, V)
            rows = torch.arange(g.shape[0], device=g.device)
            g[rows, labels[s : s + ctx.chunk]] -= 1.0
            g.mul_((valid[s : s + ctx.chunk] * scale)[:, None])
            g = g.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s : s + ctx.chunk] = g @ weight  # (c, d)
            if grad_weight is not None:
                grad_weight += (g.T @ h).to(work)  # (V, d), accumulated in the working dtype
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk: int = 1024,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
) -> Tensor:
    """F.cross_entropy(hidden @ weight.T, labels) without ever holding the (N, V) logits.

    Forward: per chunk of `chunk` rows, logits = h_c W^T (c, V), loss_r = logsumexp(logits_r) -
    logits_r[y_r]; only the logsumexp (N,) is kept. Backward recomputes each chunk's logits and
    accumulates dL/dh_c = G_c W and dL/dW += G_c^T h_c with G_c = softmax - onehot. Saved for
    backward: hidden, weight (both the caller's tensors) and (N,) vectors, so peak extra memory is
    one (chunk, V) block instead of (N, V). A frozen weight (LoRA) or hidden gets no gradient work.
    `reduction="mean"` divides by the number of non-ignored rows, as F.cross_entropy does.

    hidden: (N, d); weight: (V, d) (the LM head); labels: (N,) int. Returns a scalar in float32
    (float64 for float64 hidden).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, d) and weight (V, d), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be (N,) = {tuple(hidden.shape[:1])}, got {tuple(labels.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    valid = labels != ignore_index  # (N,)
    safe_labels = labels.masked_fill(~valid, 0).long()  # (N,)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, safe_labels, valid.float(), chunk, reduction == "mean")

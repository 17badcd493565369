"""Loss aggregation: a per-token loss (B, T) and its mask (B, T) -> one scalar.

The choice decides how much each token and each sequence weighs in the gradient:
    token-mean               sum(l * m) / sum(m)                     every token equal (DAPO, TRL "bnpo")
    seq-mean-token-mean      mean_i( sum_t(l * m) / |y_i| )          every sequence equal (GRPO, TRL "grpo")
    seq-mean-token-sum       mean_i( sum_t(l * m) )                  longer sequences weigh more
    seq-mean-token-sum-norm  sum(l * m) / (B * max_len)              Dr.GRPO: a constant normaliser
Names and the first three definitions follow verl's `agg_loss`.

Where TRL and verl differ, and what is done here:
- seq-mean-*: verl averages over sequences that have at least one valid token; TRL's "grpo" divides
  by B, counting empty rows. Empty rows are excluded here (verl): a fully masked row, e.g. one
  dropped by dynamic sampling, is not a sample and should not shrink the loss. With no empty rows
  the two agree.
- seq-mean-token-sum-norm: TRL's "dr_grpo" divides by B * max_completion_length (the Dr.GRPO
  paper's (1/G) sum_i sum_t / L_max); verl divides by max_len only. TRL's is used here, so the
  loss scale does not grow with the batch. `max_len` must be the configured maximum response
  length, a constant, not the padded width of this batch.

Every aggregation takes `max_len` so all share one call signature; only the -norm one reads it.
"""

from collections.abc import Callable

from torch import Tensor

from posttrain.algos.masked import masked_sum


def token_mean(loss: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """sum(l * m) / sum(m); 0 when nothing is valid."""
    return masked_sum(loss, mask) / mask.sum().clamp(min=1)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """Mean over non-empty sequences of each sequence's token mean."""
    tokens = mask.sum(dim=-1)  # (B,)
    per_seq = masked_sum(loss, mask, dim=-1) / tokens.clamp(min=1)  # (B,)
    return per_seq.sum() / (tokens > 0).sum().clamp(min=1)


def seq_mean_token_sum(loss: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """Mean over non-empty sequences of each sequence's token sum."""
    tokens = mask.sum(dim=-1)  # (B,)
    return masked_sum(loss, mask) / (tokens > 0).sum().clamp(min=1)


def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
    """sum(l * m) / (B * max_len), Dr.GRPO (Liu et al. 2025, arXiv:2503.20783)."""
    if max_len is None or max_len < 1:
        raise ValueError("seq-mean-token-sum-norm needs max_len, the configured maximum response length")
    return masked_sum(loss, mask) / (loss.shape[0] * max_len)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}

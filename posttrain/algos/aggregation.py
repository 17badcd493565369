"""Loss aggregation: a per-token loss (B, T) and its mask (B, T) -> one scalar, as numerator / denominator.

The choice decides how much each token and each sequence weighs in the gradient:
    token-mean               sum(l * m) / sum(m)                     every token equal (DAPO, TRL "bnpo")
    seq-mean-token-mean      mean_i( sum_t(l * m) / |y_i| )          every sequence equal (GRPO, TRL "grpo")
    seq-mean-token-sum       mean_i( sum_t(l * m) )                  longer sequences weigh more
    seq-mean-token-sum-norm  sum(l * m) / (B * max_len)              Dr.GRPO: a constant normaliser
Names and the first three definitions follow verl's `agg_loss`.

Each aggregation is a numerator (a sum over the batch's rows, so it adds up over micro-batches) and a
denominator that depends on the mask alone (a count, so it too adds up, and is known before any forward).
A minibatch split into micro-batches then divides the sum of the numerators by the sum of the
denominators and gets exactly the aggregation over the whole minibatch, whatever the split. Calling an
aggregation gives numerator / denominator (the denominator at least 1, so an empty mask gives 0).

Where TRL and verl differ, and what is done here:
- seq-mean-*: verl averages over sequences that have at least one valid token; TRL's "grpo" divides
  by B, counting empty rows. Empty rows are excluded here (verl): a fully masked row, e.g. one
  dropped by dynamic sampling, is not a sample and should not shrink the loss. With no empty rows
  the two agree.
- seq-mean-token-sum-norm: TRL's "dr_grpo" divides by B * max_completion_length (the Dr.GRPO
  paper's (1/G) sum_i sum_t / L_max); verl divides by max_len only. TRL's is used here, so the
  loss scale does not grow with the batch. `max_len` must be the configured maximum response
  length, a constant, not the padded width of this batch.

Every part takes `max_len` so all share one call signature; only the -norm denominator reads it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.masked import masked_sum


def _token_sum(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    return masked_sum(loss, mask)


def _seq_token_mean_sum(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    """The sum over sequences of each one's token mean."""
    per_seq = masked_sum(loss, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,)
    return per_seq.sum()


def _tokens(mask: Tensor, max_len: int | None) -> Tensor:
    return mask.sum()


def _sequences(mask: Tensor, max_len: int | None) -> Tensor:
    """Rows with at least one valid token."""
    return (mask.sum(dim=-1) > 0).sum()


def _rows_times_max_len(mask: Tensor, max_len: int | None) -> Tensor:
    if max_len is None or max_len < 1:
        raise ValueError("seq-mean-token-sum-norm needs max_len, the configured maximum response length")
    return torch.tensor(float(mask.shape[0] * max_len), device=mask.device)


@dataclass(frozen=True)
class Aggregation:
    """numerator(loss, mask, max_len): a 0-dim sum over the rows; denominator(mask, max_len): a 0-dim count."""

    numerator: Callable[[Tensor, Tensor, int | None], Tensor]
    denominator: Callable[[Tensor, int | None], Tensor]

    def __call__(self, loss: Tensor, mask: Tensor, *, max_len: int | None = None) -> Tensor:
        """numerator / denominator over this batch; 0 when nothing is valid."""
        denominator = self.denominator(mask, max_len)
        return self.numerator(loss, mask, max_len) / denominator.clamp(min=1)


token_mean = Aggregation(_token_sum, _tokens)
seq_mean_token_mean = Aggregation(_seq_token_mean_sum, _sequences)
seq_mean_token_sum = Aggregation(_token_sum, _sequences)
seq_mean_token_sum_norm = Aggregation(_token_sum, _rows_times_max_len)  # Dr.GRPO (Liu et al. 2025, arXiv:2503.20783)

AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}

"""Just enough of a model and an Accelerator to run TRL's own loss code on tensors we choose.

How TRL is called (trl 1.16): a trainer is made with `object.__new__(TrainerClass)`, skipping its
__init__ (no model download, no datasets), and given only the attributes its loss method reads;
those are listed next to each builder in the tests. The loss method itself is TRL's, unmodified.
"""

from collections import defaultdict
from types import SimpleNamespace

import torch


class FakeAccelerator:
    """Single process: every gather / reduce is the identity."""

    device = torch.device("cpu")
    num_processes = 1
    process_index = 0
    sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_for_metrics(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


class TokenTableModel:
    """Stands in for a model called with `fused_lm_head=True`: log p(token) = table[token].

    TRL's fused head returns `log_probs` (B, L-1) for the shifted labels, 0 where the label is -100;
    this does the same, so the test can compute identical per-token logps itself.
    """

    training = True

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # (V,) log-probabilities

    def per_token_logps(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels[:, 1:]  # (B, L-1): token t+1 is predicted at position t
        valid = shifted != -100
        return torch.where(valid, self.table[shifted.clamp(min=0)], torch.zeros((), dtype=self.table.dtype))

    def __call__(self, *, labels: torch.Tensor, **_: object) -> SimpleNamespace:
        log_probs = self.per_token_logps(labels)
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(
            log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=torch.zeros_like(log_probs, dtype=torch.bool)
        )


def new_metrics() -> dict[str, defaultdict]:
    return {"train": defaultdict(list), "eval": defaultdict(list)}


def sequences(batch: int, length: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random prompt + completion + right padding rows: input_ids, attention_mask, completion_mask (batch, length)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, length), generator=gen)
    prompt = torch.randint(2, 5, (batch, 1), generator=gen)
    completion = torch.randint(1, length - 5, (batch, 1), generator=gen)
    pos = torch.arange(length)
    attention_mask = (pos < prompt + completion).long()
    completion_mask = ((pos >= prompt) & (pos < prompt + completion)).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}

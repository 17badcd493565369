"""What a proposer hands the speculative decoder, the interface both proposers share, and the random numbers
that drafting and the acceptance test draw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from posttrain.engine.sequence import Sequence


@dataclass
class Proposal:
    """Drafted tokens for one sequence. `probs` (len(token_ids), V): the distribution each was drawn from, or None
    when each is a point mass (n-gram lookup; a draft model drafting for a greedy request). `kind`: the class whose
    acceptance rate it shares (draft_length.py): an n-gram match's length, 0 for the draft model."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    kind: int = 0


NO_PROPOSAL = Proposal([])


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Proposal]:
        """Up to max_drafts[i] tokens to follow seqs[i]'s tokens (decoding sequences, each with max_drafts >= 1)."""
        ...

    def release(self) -> None:
        """Forget every sequence (the engine is idle or its requests are gone)."""
        ...

    def stats(self) -> dict[str, float]: ...


def sequence_uniforms(seqs: list[Sequence], count: int, device: torch.device) -> torch.Tensor:
    """`count` uniforms in [0, 1) per sequence, fp64: from its own generator when seeded (its tokens then do not
    depend on the batch), else torch's default one; zeros for greedy sequences, which draw nothing. (S, count)"""
    uniforms = torch.zeros(len(seqs), count, dtype=torch.float64)
    for row, seq in enumerate(seqs):
        if not seq.params.is_greedy:
            generator = seq.generator
            where = generator.device if generator is not None else "cpu"
            uniforms[row] = torch.rand(count, dtype=torch.float64, generator=generator, device=where).cpu()
    return uniforms.to(device)

"""Prompt-lookup drafts: find the sequence's last n tokens earlier in its own prompt and output, propose what
followed them there. Free to compute, and right wherever the output copies its context (quoting, editing code,
repeating a list, a model stuck in a loop).

Each sequence keeps an index from every n-gram (ngram_min <= n <= ngram_max) to the end of its latest occurrence
that has a token after it, brought up to date with the tokens added since the last step: a lookup is one dict
probe per n, longest n first.
"""

from __future__ import annotations

from posttrain.engine.sequence import Sequence, SequenceStatus
from posttrain.engine.speculative.proposal import NO_PROPOSAL, Proposal


class NgramIndex:
    """The n-grams of one token list, each mapped to the end (exclusive) of its latest occurrence followed by a
    token. Extended as the list grows (it never shrinks: a sequence's tokens only grow)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in the index

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams not indexed yet that have a token after them (those ending before len(tokens))."""
        for end in range(max(self.num_indexed, self.ngram_min), len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self.latest_end[tuple(tokens[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix found. Where the
        match runs into the end of `tokens`, the proposal continues with its own tokens (a repeating pattern goes
        on repeating). [] when no suffix of ngram_min tokens occurred before."""
        return self.match(tokens, count)[0]

    def match(self, tokens: list[int], count: int) -> tuple[list[int], int]:
        """`lookup`'s proposal and the length of the suffix it matched (0 with no proposal)."""
        length = len(tokens)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            end = self.latest_end.get(tuple(tokens[length - n :]))
            if end is None:
                continue
            proposal: list[int] = []
            for i in range(count):
                j = end + i
                proposal.append(tokens[j] if j < length else proposal[j - length])
            return proposal, n
        return [], 0


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.indexes: dict[int, tuple[Sequence, NgramIndex]] = {}  # seq_id -> (sequence, its index)

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Proposal]:
        self._forget_finished()
        proposals = []
        for seq, count in zip(seqs, max_drafts):
            entry = self.indexes.get(seq.seq_id)
            if entry is None:
                entry = self.indexes[seq.seq_id] = (seq, NgramIndex(self.ngram_min, self.ngram_max))
            index = entry[1]
            index.update(seq.token_ids)
            drafts, matched = index.match(seq.token_ids, count)
            proposals.append(Proposal(drafts, kind=matched) if drafts else NO_PROPOSAL)
        return proposals

    def _forget_finished(self) -> None:
        done = [seq_id for seq_id, (seq, _) in self.indexes.items() if seq.status is SequenceStatus.FINISHED]
        for seq_id in done:
            del self.indexes[seq_id]

    def release(self) -> None:
        self.indexes.clear()

    def stats(self) -> dict[str, float]:
        return {}

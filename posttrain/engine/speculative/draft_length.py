"""How many of a proposal's drafts to check: the count that appends the most tokens per second, from what the
engine has seen.

A checked draft costs a row of the target's forward and of the acceptance test whether it is accepted or not. At a
low acceptance rate (a chat answer whose n-gram matches are mostly one common token long) checking 4 drafts a step
made decoding slower than not speculating at all; at a high one (quoting, code edits, a model repeating itself)
every extra draft pays. `DraftLength` estimates both sides as it goes and picks, per proposal, the count k in
[0, proposed] with the most expected tokens per unit of step time:

    tokens(k) = 1 + p + p^2 + ... + p^k     (the drafts accepted in a row, plus the target's own token)
    cost(k)   = T(k) / T(0)                 (a step with k draft rows, in plain steps)

(in a step of several sequences, each in turn, counting the tokens and rows the ones before it chose).

- p, per kind of proposal (an n-gram match of length n is kind n; the draft model's proposals are one kind): the
  share of checked drafts accepted, given the ones before it were, with one accepted and one rejected draft as
  the prior. Both counts decay a little at every step that could draft, so the estimate follows the text, and a
  kind whose drafts stopped being checked drifts back to the prior and is tried again now and then.
- T(r), per number of sequences in the step and number r of draft rows in it: the seconds of the engine's own
  decode steps of that shape (timed whole: proposing, the forward, the acceptance test), an average kept once
  MIN_TIMED of them were seen (the first check of a run pays one-time costs); until then `guessed_step_cost`, an
  optimistic guess that gets the shape tried and timed: a step as a fixed part (the weights' bytes) plus a part per
  row, one row costing DEFAULT_ROW_COST of a one-row step, so that r extra rows in a step of S sequences cost
  r c / (1 + (S - 1) c) of it (0.1 a row at batch 1, 0.014 at 64 sequences). Not a line: at SmolLM2's batch 1 on CPU in
  q8_0, the first draft row cost ~0.3 of a plain step (a checking step's fixed costs) and each further one ~0.1.
  Where a step is mostly Python (a tiny model) a draft row costs about a plain step, and drafting stops.

The choice changes only which drafts are checked, never the output: greedy decoding stays token for token the
plain decode, and sampling draws from the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ROW_COST = 0.1  # a row's share of a one-row step's time, for a step shape not timed yet
DECAY = 0.98  # per drafting step: acceptance counts from ~50 such steps ago weigh a third
TIME_EMA = 0.1  # weight of the newest step in the step-time averages
MIN_TIMED = 3  # steps of a shape before its measured time replaces the guess


@dataclass
class Acceptance:
    """A kind's drafts accepted and checked (decayed counts), and the rate they give."""

    accepted: float = 0.0
    checked: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 1.0) / (self.checked + 2.0)  # one accepted and one rejected draft as the prior


def expected_tokens(rate: float, drafts: int) -> float:
    """1 + p + ... + p^k: the drafts accepted in a row plus the target's own token."""
    return sum(rate**j for j in range(drafts + 1))


def guessed_step_cost(num_seqs: int, rows: int) -> float:
    """A decode step of `num_seqs` sequences and `rows` draft rows, in plain steps, before any was timed."""
    c = DEFAULT_ROW_COST
    return 1.0 + rows * c / (1.0 + (num_seqs - 1) * c)


def _best(tokens, cost, most: int) -> int:  # noqa: ANN001 (callables of k)
    """The k in [0, most] with the most tokens(k) per cost(k), the smallest on ties."""
    best, best_value = 0, tokens(0) / cost(0)
    for k in range(1, most + 1):
        value = tokens(k) / cost(k)
        if value > best_value * (1.0 + 1e-9):
            best, best_value = k, value
    return best


class DraftLength:
    def __init__(self) -> None:
        self.acceptance: dict[int, Acceptance] = {}
        self.step_s: dict[tuple[int, int], float] = {}  # (sequences, draft rows) -> a decode step's seconds (EMA)
        self.timed: dict[tuple[int, int], int] = {}  # (sequences, draft rows) -> steps timed

    def step_cost(self, num_seqs: int, rows: int) -> float:
        """A decode step of `num_seqs` sequences with `rows` draft rows, in plain steps of as many sequences."""
        if rows == 0:
            return 1.0
        if min(self.timed.get((num_seqs, 0), 0), self.timed.get((num_seqs, rows), 0)) < MIN_TIMED:
            return guessed_step_cost(num_seqs, rows)
        return self.step_s[num_seqs, rows] / self.step_s[num_seqs, 0]

    def choose(self, proposals: list[tuple[int, int]], num_seqs: int) -> list[int]:
        """How many drafts to check of each (kind, proposed count) of a step of `num_seqs` decoding sequences: for
        each in turn the count with the most expected tokens of the step per unit of its time (0 where none was
        proposed)."""
        tokens, rows, counts = float(num_seqs), 0, []
        for kind, proposed in proposals:
            if proposed == 0:
                counts.append(0)
                continue
            rate = self.acceptance.setdefault(kind, Acceptance()).rate
            base, before = tokens - 1.0, rows
            k = _best(
                lambda k: base + expected_tokens(rate, k),  # noqa: B023 (used in this iteration)
                lambda k: self.step_cost(num_seqs, before + k),  # noqa: B023
                proposed,
            )
            counts.append(k)
            tokens += expected_tokens(rate, k) - 1.0
            rows += k
        return counts

    def drafting_step(self) -> None:
        """A step that could draft: older acceptance counts weigh less."""
        for stats in self.acceptance.values():
            stats.accepted *= DECAY
            stats.checked *= DECAY

    def checked(self, kind: int, drafts: int, accepted: int) -> None:
        """A check of `drafts` drafts of `kind` accepted the first `accepted`: each accepted one counts, and the
        first rejected one (the later ones were never reached, so say nothing about p)."""
        stats = self.acceptance.setdefault(kind, Acceptance())
        stats.accepted += accepted
        stats.checked += min(accepted + 1, drafts)

    def step_took(self, num_seqs: int, draft_rows: int, seconds: float) -> None:
        """A decode step of `num_seqs` sequences with `draft_rows` drafts in all took `seconds`."""
        key = (num_seqs, draft_rows)
        before = self.step_s.get(key)
        self.step_s[key] = seconds if before is None else before + TIME_EMA * (seconds - before)
        self.timed[key] = self.timed.get(key, 0) + 1

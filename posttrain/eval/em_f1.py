"""Exact match and token-level F1 of generated answers against references (SQuAD's metrics).

Both compare *normalised* text: lowercase, punctuation removed, the articles a / an / the removed,
whitespace collapsed. EM is 1 when the normalised prediction equals a normalised reference; F1 is the
harmonic mean of precision and recall of the bag of normalised tokens (1 when both are empty, 0 when
only one is). A row may give several references (a list in the answer column): each metric takes the
best over them. Means run over scorable samples; a row with no usable reference (null, empty list) is
unscorable and counted apart.

`extract` (a regex) pulls the answer out of the completion first: the LAST non-empty match counts (a
final answer comes last), its group "answer" if the pattern names one, else its first group, else the whole
match. A completion with no match predicts the empty string (EM 0, F1 0) and is counted in `no_match`.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.data.validate import DataError
from posttrain.engine import LLM
from posttrain.errors import PosttrainError
from posttrain.eval.generation import Sampling, sample
from posttrain.eval.prompts import ANSWER_KEY
from posttrain.rollout.batch import PROMPT_KEY

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
SAMPLES_KEPT = 200


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def references_of(value: Any, where: str) -> list[str]:
    """A reference column value as a list of strings: a string, a number, or a list of those ([] = none)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise DataError(
                f"{where}: answer {item!r} is a {type(item).__name__}; expected a string, a number or a list of them"
            )
        out.append(str(item))
    return out


def compile_extract(pattern: str | None) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise PosttrainError(f"--extract {pattern!r} is not a valid regular expression: {error}") from None


def extract_answer(text: str, pattern: re.Pattern[str] | None) -> str | None:
    """The answer part of a completion (see the module docstring); None when the pattern does not match."""
    if pattern is None:
        return text
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    # The last match that consumed text: a pattern that can match empty ("(.*)") also matches at the very end.
    match = next((m for m in reversed(matches) if m.end() > m.start()), matches[-1])
    if "answer" in pattern.groupindex:
        return match.group("answer") or ""
    return (match.group(1) if pattern.groups else match.group(0)) or ""


@dataclass
class EMF1Result:
    exact_match: float | None  # mean over scorable samples
    f1: float | None
    samples: int
    scorable: int
    unscorable: int  # rows without a reference
    no_match: int  # completions the --extract pattern found nothing in
    problems: int
    samples_per_problem: int
    records: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("records")
        return out


def score_em_f1(
    completions: Sequence[str],
    references: Sequence[list[str]],
    extract: str | None = None,
) -> tuple[list[float | None], list[float | None], int]:
    """(EM per sample, F1 per sample, samples without a match); None where a sample has no reference."""
    pattern = compile_extract(extract)
    ems: list[float | None] = []
    f1s: list[float | None] = []
    no_match = 0
    for text, refs in zip(completions, references, strict=True):
        predicted = extract_answer(text, pattern)
        no_match += predicted is None
        if not refs:
            ems.append(None)
            f1s.append(None)
            continue
        predicted = predicted or ""
        ems.append(max(exact_match(predicted, ref) for ref in refs))
        f1s.append(max(token_f1(predicted, ref) for ref in refs))
    return ems, f1s, no_match


def evaluate_em_f1(
    llm: LLM,
    rows: list[dict[str, Any]],
    *,
    extract: str | None = None,
    sampling: Sampling = Sampling(),
    locations: Sequence[str] | None = None,
    progress: bool = False,
) -> EMF1Result:
    """Generate for every row and score each sample's answer against the row's `answer` references."""
    if not rows:
        raise PosttrainError("no prompts to evaluate")
    compile_extract(extract)  # a bad pattern fails before any generation
    where = list(locations) if locations is not None else [f"row {i}" for i in range(len(rows))]
    refs_per_row = []
    for row, location in zip(rows, where):
        if ANSWER_KEY not in row:
            raise DataError(f"{location}: no {ANSWER_KEY!r} (reference) column (columns: {', '.join(row)})")
        refs_per_row.append(references_of(row[ANSWER_KEY], location))
    batch = sample(llm, rows, sampling, progress)
    n = batch.group_size
    refs = [refs_per_row[b // n] for b in range(batch.num_samples)]
    ems, f1s, no_match = score_em_f1(batch.texts, refs, extract)
    scored = [b for b, em in enumerate(ems) if em is not None]
    records = [
        {
            "problem": b // n,
            "sample": b % n,
            "prompt": rows[b // n][PROMPT_KEY],
            "completion": batch.texts[b],
            "references": refs[b],
            "exact_match": ems[b],
            "f1": f1s[b],
        }
        for b in range(min(batch.num_samples, SAMPLES_KEPT))
    ]
    return EMF1Result(
        exact_match=sum(ems[b] for b in scored) / len(scored) if scored else None,  # type: ignore[misc]
        f1=sum(f1s[b] for b in scored) / len(scored) if scored else None,  # type: ignore[misc]
        samples=batch.num_samples,
        scorable=len(scored),
        unscorable=batch.num_samples - len(scored),
        no_match=no_match,
        problems=batch.num_groups,
        samples_per_problem=n,
        records=records,
    )

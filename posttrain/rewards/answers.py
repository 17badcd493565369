"""Verifiable answer rewards: the final number, GSM8K's `#### n`, and `\\boxed{}` answers.

Each returns 1.0 (right) or 0.0 (wrong) per sample, and None (unscorable) where the reference is
missing: a completion with no answer in it is a wrong answer (0.0); a row with no reference answer
cannot be judged at all (None). Numbers compare exactly as decimals, so "85", "85.0", "$85" and
"85." are the same answer, and "1,234" is one thousand two hundred thirty-four.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from decimal import Decimal
from functools import lru_cache
from types import ModuleType
from typing import Any

from posttrain.rewards.base import completion_text

# One number as people and models write it: an optional sign (ASCII or unicode minus) and dollar sign,
# digits with optional thousands commas ("1,234,567" — groups of exactly three), optional decimals.
# Not preceded by a letter, digit or '.', so "H2O" or "v1.2" do not count as numbers and "3-5" is 3 then 5.
# A trailing period ("is 85.") is the end of a sentence, not part of the number.
_NUMBER = (
    r"(?P<sign>[-\u2212])?\$?(?P<sign2>[-\u2212])?"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)
NUMBER_RE = re.compile(r"(?<![\w.])" + _NUMBER)
_WHOLE_NUMBER_RE = re.compile(r"\s*" + _NUMBER + r"\s*\.?\s*")
# GSM8K's answer line: "#### 72" (the reference format, and what our gsm8k prompt asks for).
_GSM8K_ANSWER_RE = re.compile(r"####\s*" + _NUMBER)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _to_decimal(match: re.Match[str]) -> Decimal:
    value = Decimal(match.group("digits").replace(",", ""))
    return -value if (match.group("sign") or match.group("sign2")) else value


def last_number(text: str) -> Decimal | None:
    """The last number written in `text`, or None if there is none."""
    matches = list(NUMBER_RE.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def parse_number(text: str) -> Decimal | None:
    """`text` read as exactly one number (surrounding spaces, `$`, commas, a final '.' allowed), else None."""
    match = _WHOLE_NUMBER_RE.fullmatch(text)
    return None if match is None else _to_decimal(match)


def gsm8k_final_answer(text: str) -> Decimal | None:
    """The number after the last `#### ` in `text`, or None if there is no `#### <number>`."""
    matches = list(_GSM8K_ANSWER_RE.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def reference_number(value: Any, *, column: str = "answer", index: int = 0) -> Decimal | None:
    """A reference answer as a Decimal; None for a missing (None / empty) or non-numeric reference."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, Decimal)):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(repr(value)) if value == value and abs(value) != float("inf") else None
    if isinstance(value, str):
        return parse_number(value) if value.strip() else None
    raise TypeError(f"{column}[{index}] is a {type(value).__name__}, expected a number or a string")


def _check_batch(completions: Sequence[Any], answers: Sequence[Any], fn_name: str) -> None:
    if len(answers) != len(completions):
        raise ValueError(f"{fn_name}: {len(completions)} completions but {len(answers)} answers")


def numeric_match(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 if the last number of the completion equals the `answer` column, else 0.0.

    The reference must be a number (int / float / numeric string such as "85" or "1,234"); a missing
    or non-numeric reference gives None. A completion without any number is wrong (0.0).
    """
    _check_batch(completions, answer, "numeric_match")
    rewards: list[float | None] = []
    for i, (completion, ref) in enumerate(zip(completions, answer)):
        expected = reference_number(ref, index=i)
        if expected is None:
            rewards.append(None)
            continue
        got = last_number(completion_text(completion))
        rewards.append(1.0 if got == expected else 0.0)
    return rewards


def gsm8k(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """GSM8K accuracy: the reference is the number after `####` in the `answer` column (a bare number
    is accepted too); the completion's answer is its last `#### n` if it writes one, else its last number.
    """
    _check_batch(completions, answer, "gsm8k")
    rewards: list[float | None] = []
    for i, (completion, ref) in enumerate(zip(completions, answer)):
        if isinstance(ref, str) and "####" in ref:
            expected = gsm8k_final_answer(ref)
        else:
            expected = reference_number(ref, index=i)
        if expected is None:
            rewards.append(None)
            continue
        text = completion_text(completion)
        got = gsm8k_final_answer(text)
        if got is None:
            got = last_number(text)
        rewards.append(1.0 if got == expected else 0.0)
    return rewards


# ---- \boxed{} answers ------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces included;
    None if there is none or its braces never close."""
    starts = [match.end() for match in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start:pos]
    return None


_LATEX_SPACING = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")


def normalize_latex_answer(answer: str) -> str:
    """A plain-string normal form of a short LaTeX answer, for the comparison without math_verify:
    no `$`, spacing commands, whitespace, `\\text{}` wrappers, degree or percent signs, trailing '.';
    `\\dfrac` / `\\tfrac` read as `\\frac`."""
    text = answer.strip().strip("$")
    for command in _LATEX_SPACING:
        text = text.replace(command, "")
    text = _LATEX_TEXT_RE.sub(r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for unit in ("^{\\circ}", "^\\circ", "\\%", "%"):
        text = text.replace(unit, "")
    return re.sub(r"\s+", "", text).rstrip(".")


def _strings_equivalent(pred: str, ref: str) -> bool:
    pred_norm, ref_norm = normalize_latex_answer(pred), normalize_latex_answer(ref)
    if pred_norm == ref_norm:
        return True
    pred_num, ref_num = parse_number(pred_norm), parse_number(ref_norm)
    return pred_num is not None and pred_num == ref_num


@lru_cache(maxsize=1)
def math_verify_backend() -> ModuleType | None:
    """The `math_verify` module if installed (`pip install math-verify`), else None."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _math_verify_equivalent(backend: ModuleType, pred: str, ref: str) -> bool:
    # math_verify times out with signal.alarm, which only works on the main thread; elsewhere it must
    # run without a timeout (its own advice), which is acceptable for short boxed answers.
    on_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if on_main else None
    gold = backend.parse(f"\\boxed{{{ref}}}", parsing_timeout=timeout)
    if not gold:  # math_verify cannot read the reference: the string comparison (already false) decides
        return False
    guess = backend.parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
    return bool(backend.verify(gold, guess, timeout_seconds=timeout))


def boxed(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 if the completion's last `\\boxed{}` answer equals the reference, else 0.0.

    The reference is the `answer` column (its last `\\boxed{}` if it has one, else the whole value).
    Equal after `normalize_latex_answer` (or as numbers) is always right. Otherwise, with `math_verify`
    installed, its symbolic check decides (1/2 = 0.5 = \\frac{1}{2}, x^2+1 = 1+x^2); without it the
    answer is wrong. No `\\boxed{}` in the completion = 0.0; missing reference = None; a math_verify
    failure on one sample = None for that sample.
    """
    _check_batch(completions, answer, "boxed")
    rewards: list[float | None] = []
    for i, (completion, ref) in enumerate(zip(completions, answer)):
        if ref is None or isinstance(ref, bool):
            rewards.append(None)
            continue
        if not isinstance(ref, (str, int, float, Decimal)):
            raise TypeError(f"answer[{i}] is a {type(ref).__name__}, expected a string or a number")
        ref_text = str(ref)
        ref_text = last_boxed(ref_text) or ref_text
        if not ref_text.strip():
            rewards.append(None)
            continue
        pred = last_boxed(completion_text(completion))
        if pred is None or not pred.strip():
            rewards.append(0.0)
        elif _strings_equivalent(pred, ref_text):
            rewards.append(1.0)
        elif (backend := math_verify_backend()) is None:  # imported on first need (sympy is slow to load)
            rewards.append(0.0)
        else:
            try:
                rewards.append(1.0 if _math_verify_equivalent(backend, pred, ref_text) else 0.0)
            except Exception:  # a parser bug or timeout on this sample: unscorable, never a silent 0
                rewards.append(None)
    return rewards

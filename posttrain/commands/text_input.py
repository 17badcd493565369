"""Text from the command line, a prompts file or standard input, held to UTF-8.

One policy, the dataset readers' (posttrain.data.readers): text that is not UTF-8 is refused, naming the
input, its line where it has lines, and the column of the first bad byte, e.g. `p.txt:3:5: invalid UTF-8
(byte 0xff)` (columns count characters from 1). Nothing is replaced: a prompt with U+FFFD where the user's bytes
were is another prompt, and the model's answer to it would look like an answer to the one they sent.

Python hands over undecodable bytes of argv (and, under a C / C.UTF-8 locale, of stdin) as lone surrogates
(`surrogateescape`), which the tokenizer cannot take; `text_problem` turns them back into the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.data.readers import utf8_error
from posttrain.errors import PosttrainError

# A problem is (column, reason): the column counts characters from 1, as the dataset readers' `file:line:column`.
Problem = tuple[int, str]


def text_problem(text: str) -> Problem | None:
    """None if `text` can be encoded as UTF-8, else where and why not: the undecodable byte it came from (a
    surrogate-escaped argv or stdin), or the lone surrogate it holds."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    try:
        problem = utf8_error(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a surrogate outside U+DC80..U+DCFF: no byte ever made it
        problem = None
    return problem or lone_surrogate_problem(text)


def lone_surrogate_problem(text: str) -> Problem | None:
    """None unless `text` holds a lone surrogate (half of a UTF-16 pair: a code point, but not text)."""
    first = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if first is None:
        return None
    return first + 1, f"holds the lone surrogate U+{ord(text[first]):04X}, which is not text"


def at(where: str, problem: Problem) -> str:
    """`where:column: reason`, the readers' way of naming a place in a line."""
    return f"{where}:{problem[0]}: {problem[1]}"


def check_argument(text: str, option: str) -> str:
    """`text` (an argv value of `option`), or a PosttrainError naming the option and the bad byte."""
    problem = text_problem(text)
    if problem is not None:
        raise PosttrainError(f"{option}: {problem[1]} at character {problem[0]}")
    return text


def json_text_problem(value: Any) -> Problem | None:
    """None unless a string inside a decoded JSON value holds a lone surrogate (an unpaired `\\udcff` escape,
    which JSON decodes but UTF-8 cannot encode); the problem of the first such string."""
    if isinstance(value, str):
        return lone_surrogate_problem(value)
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((p for p in map(json_text_problem, children) if p is not None), None)


def decode_line(raw: bytes | str, first_line: bool = False) -> tuple[str, Problem | None]:
    """(the line as text, None) or ("", what is wrong with it). Bytes are decoded strictly (a UTF-8 byte-order
    mark dropped from the first line); text, as a text stream hands it over, is checked for escaped bytes."""
    if isinstance(raw, str):
        problem = text_problem(raw)
        return ("", problem) if problem is not None else (raw, None)
    problem = utf8_error(raw)  # a first line's byte-order mark counts as a character of the line
    return ("", problem) if problem is not None else (raw.decode("utf-8-sig" if first_line else "utf-8"), None)


def read_text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its ending) of a UTF-8 text file; the first bad line is a
    PosttrainError naming `path:line` and the byte."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PosttrainError(f"{path}: cannot read: {e.strerror}") from None
    for number, raw in enumerate(data.splitlines(), 1):
        text, problem = decode_line(raw, first_line=number == 1)
        if problem is not None:
            raise PosttrainError(at(f"{path}:{number}", problem))
        yield number, text

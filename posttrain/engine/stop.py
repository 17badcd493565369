"""Output text and stop strings: incremental detokenization, stop-string search, safe streaming.

The engine speaks token ids; text exists only to find stop strings and to stream. Per sequence and
per generated token, the engine does:

    delta = detokenizer.add(token_id)                        # new text, "" while a char is split
    hit = find_stop(detokenizer.text, params.stop, len(delta))
    if hit:                                                   # finish, reason "stop"
        text = truncate_at_stop(detokenizer.text, *hit, params.include_stop_str_in_output)
    else:                                                     # stream what cannot become a stop
        ready = detokenizer.text[:safe_text_len(detokenizer.text, params.stop)]

and when a sequence ends for another reason (EOS, stop token, length) it calls
`detokenizer.flush()` for any held-back tail, then checks stop strings once more on that delta.
As in vLLM, stop strings are not checked before `min_tokens` tokens exist, and the token ids are
never cut at a stop string: only the text is.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character

# Prompt tokens decoded in front of the output so the first output token decodes as it would
# in context (sentencepiece drops a leading space at the start of a decode). vLLM uses 5.
_CONTEXT_TOKENS = 5

# The decode window restarts only at a token boundary that is also a character boundary. If
# none comes for this many tokens, the trailing U+FFFD is taken for garbage bytes (a model can
# emit stray byte tokens) and emitted, which bounds the window and so the cost of a decode.
_MAX_HELD_TOKENS = 32


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes one sequence's output a token at a time, emitting only finished characters.

    Two offsets into the ids (a little prompt context, then the output), as in vLLM: decoding
    starts at `prefix_offset`, a few tokens back, so merges and leading spaces come out as in a
    full decode, and the text up to `read_offset` is already out. New text is
    decode(prefix..end) minus decode(prefix..read). Byte-level BPE splits multi-byte characters
    across tokens, and a decode of a truncated character ends in one U+FFFD: that last
    character is held back until a later token completes it; everything before it goes out at
    once. The offsets move on when the decode ends cleanly. Only `tokenizer.decode` is used.

    A character split between the prompt and the output counts as prompt text.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # context, then the output
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._emitted_past_read = 0  # characters after prefix_text already out, window not clean
        self._text = ""

    @property
    def text(self) -> str:
        """The output text emitted so far (without a held-back incomplete character)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes ("" while a character is split)."""
        self._ids.append(token_id)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        clean = not window_text.endswith(REPLACEMENT_CHAR) or len(self._ids) - self._read_offset > _MAX_HELD_TOKENS
        return self._emit(window_text if clean else window_text[:-1], clean)

    def flush(self) -> str:
        """At the end of the sequence: emit whatever is held back (U+FFFD for a broken tail)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix_offset, len(self._ids)), clean=True)

    def _emit(self, ready_text: str, clean: bool) -> str:
        delta = ready_text[len(self._prefix_text) + self._emitted_past_read :]
        if clean:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            self._emitted_past_read = 0
        else:
            self._emitted_past_read += len(delta)
        self._text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)


def find_stop(text: str, stop: list[str], new_text_len: int) -> tuple[int, str] | None:
    """The stop string that the last `new_text_len` characters of `text` complete, as
    (index where it starts in `text`, the stop string), or None.

    Only the tail that can hold a newly completed match is searched: a stop string may start in
    older text (it can span tokens) but must end in the new text; earlier matches were found
    when they completed. When several complete, the one that ends first wins (it would have
    stopped generation first had the text come a character at a time), then the longest.
    """
    if new_text_len <= 0:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop_str in stop:
        window_start = max(0, len(text) - new_text_len - len(stop_str) + 1)
        start = text.find(stop_str, window_start)
        if start >= 0 and (best is None or (start + len(stop_str), start) < best[:2]):
            best = (start + len(stop_str), start, stop_str)
    return None if best is None else (best[1], best[2])


def truncate_at_stop(text: str, index: int, stop_str: str, include_stop_str_in_output: bool) -> str:
    """The final output text for a stop string found at `index`: up to it, or through it."""
    return text[: index + len(stop_str)] if include_stop_str_in_output else text[:index]


def safe_text_len(text: str, stop: list[str]) -> int:
    """How much of `text` may be streamed now: all of it but the longest suffix that is a proper
    prefix of some stop string, which the next tokens could complete into a stop (and the stop
    string is not shown unless `include_stop_str_in_output`)."""
    held = 0
    for stop_str in stop:
        for length in range(min(len(stop_str) - 1, len(text)), held, -1):  # longest first
            if text.endswith(stop_str[:length]):
                held = length
                break
    return len(text) - held

"""Incremental detokenization and stop strings, on a real byte-level BPE trained in the test and on
fake tokenizers that pin down one behaviour each."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from posttrain.engine.stop import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    find_stop,
    safe_text_len,
    truncate_at_stop,
)

CORPUS = "hello world, the answer is 42. </answer> café naïve Ærøskøbing 日本語 emoji 🙂 👩‍💻"


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """A small byte-level BPE (GPT-2 style): with 300 ids most non-ASCII characters stay split
    across several byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS] * 10, trainer)
    return tokenizer


class ByteTokens:
    """Fake byte-level tokenizer: each id is a byte string; decode joins and decodes with
    errors="replace", which is what byte-level BPE decoders do."""

    def __init__(self, pieces: list[bytes], special: dict[int, str] | None = None) -> None:
        self.pieces, self.special = pieces, special or {}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text, pending = "", b""
        for i in ids:
            if i in self.special:
                text += pending.decode("utf-8", errors="replace")
                text += "" if skip_special_tokens else self.special[i]
                pending = b""
            else:
                pending += self.pieces[i]
        return text + pending.decode("utf-8", errors="replace")


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


# --- IncrementalDetokenizer -----------------------------------------------------------------


@pytest.mark.parametrize("text", ["café naïve", "日本語 🙂", " Ærøskøbing, 👩‍💻!", "the answer is 42"])
def test_byte_bpe_deltas_rebuild_the_text_without_replacement_chars(byte_bpe, text):
    prompt = byte_bpe.encode("hello world").ids
    ids = byte_bpe.encode(text).ids
    detokenizer = IncrementalDetokenizer(byte_bpe, prompt, skip_special_tokens=True)
    deltas = stream(detokenizer, ids)
    assert "".join(deltas) == detokenizer.text == byte_bpe.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_byte_bpe_really_splits_characters_across_tokens(byte_bpe):
    # guards the test above: some token must decode to a partial character on its own
    ids = byte_bpe.encode("日本語 🙂").ids
    assert any(REPLACEMENT_CHAR in byte_bpe.decode([i]) for i in ids)
    deltas = stream(IncrementalDetokenizer(byte_bpe, []), ids)
    assert "" in deltas[:-1]  # held back while a character was incomplete


def test_a_character_split_over_three_tokens_comes_out_whole_once():
    euro = "€".encode()  # 3 bytes
    tokenizer = ByteTokens([b"a", euro[:1], euro[1:2], euro[2:], b"b"])
    detokenizer = IncrementalDetokenizer(tokenizer, [0])
    assert stream(detokenizer, [1, 2, 3, 4]) == ["", "", "€", "b", ""]


def test_an_incomplete_tail_is_held_until_flush():
    tokenizer = ByteTokens([b"x", "é".encode()[:1]])
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(0) == "x"
    assert detokenizer.add(1) == ""
    assert detokenizer.text == "x"
    assert detokenizer.flush() == REPLACEMENT_CHAR  # the sequence ended mid-character
    assert detokenizer.flush() == ""


def test_stray_bytes_go_out_as_replacement_chars_once_followed():
    tokenizer = ByteTokens([b"\x80", b"ok"])  # a lone continuation byte is never valid
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    # only the last U+FFFD could still be the start of a character
    assert [detokenizer.add(0) for _ in range(3)] == ["", REPLACEMENT_CHAR, REPLACEMENT_CHAR]
    assert detokenizer.add(1) == REPLACEMENT_CHAR + "ok"
    assert detokenizer.text == REPLACEMENT_CHAR * 3 + "ok"


def test_endless_stray_bytes_keep_the_decode_window_bounded():
    calls: list[int] = []
    tokenizer = ByteTokens([b"\x80"])

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens)

    detokenizer = IncrementalDetokenizer(Counting(), [])
    deltas = [detokenizer.add(0) for _ in range(200)] + [detokenizer.flush()]
    assert "".join(deltas) == REPLACEMENT_CHAR * 200
    assert max(calls) <= 2 * 33


def test_characters_staggered_across_token_boundaries():
    text = "日本語の文章"  # 3-byte characters cut into 2-byte tokens: rarely on a boundary
    data = text.encode()
    pieces = [data[i : i + 2] for i in range(0, len(data), 2)]
    detokenizer = IncrementalDetokenizer(ByteTokens(pieces), [])
    deltas = stream(detokenizer, list(range(len(pieces))))
    assert "".join(deltas) == text and all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas[:3] == ["", "日", "本"]  # each character as soon as its last byte is in


@pytest.mark.parametrize("skip, expected", [(True, ["hi", "", " there"]), (False, ["hi", "<eos>", " there"])])
def test_special_tokens(skip, expected):
    tokenizer = ByteTokens([b"hi", b" there"], special={2: "<eos>"})
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    assert [detokenizer.add(i) for i in (0, 2, 1)] == expected


class LeadingSpaceDropper:
    """Fake sentencepiece: '▁' marks a space, and a decode drops the space at its very start."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_prompt_context_keeps_the_first_token_s_leading_space():
    tokenizer = LeadingSpaceDropper(["▁Hello", "▁world", "!"])
    detokenizer = IncrementalDetokenizer(tokenizer, [0])
    assert stream(detokenizer, [1, 2]) == [" world", "!", ""]
    assert IncrementalDetokenizer(tokenizer, []).add(1) == "world"  # nothing before it: as decode


def test_only_a_few_prompt_tokens_are_decoded(byte_bpe):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return byte_bpe.decode(ids, skip_special_tokens=skip_special_tokens)

    prompt = byte_bpe.encode(CORPUS * 5).ids
    stream(IncrementalDetokenizer(Counting(), prompt), byte_bpe.encode("hello world").ids)
    assert max(calls) <= 10


# --- stop strings ---------------------------------------------------------------------------


def test_find_stop_spanning_tokens():
    text = ""
    hits = []
    for delta in ["The answer", " is 4", "2 </an", "swer>", " more"]:
        text += delta
        hits.append(find_stop(text, ["</answer>"], len(delta)))
    assert hits == [None, None, None, (17, "</answer>"), None]  # found once, when completed
    text = "The answer is 42 </answer>"
    assert truncate_at_stop(text, 17, "</answer>", include_stop_str_in_output=False) == "The answer is 42 "
    assert truncate_at_stop(text, 17, "</answer>", include_stop_str_in_output=True) == text


def test_find_stop_prefers_the_match_that_ends_first_then_the_longest():
    assert find_stop("xabc", ["abc", "b"], 3) == (2, "b")
    assert find_stop("xab", ["b", "ab"], 2) == (1, "ab")
    assert find_stop("aXbX", ["X"], 4) == (1, "X")  # the first occurrence in the new text


def test_find_stop_only_looks_at_what_the_new_text_can_complete():
    assert find_stop("STOP and then", ["STOP"], len(" then")) is None
    assert find_stop("abc", [], 3) is None
    assert find_stop("abc", ["c"], 0) is None


@pytest.mark.parametrize(
    "text, stop, safe",
    [
        ("Hello ST", ["STOP"], 6),
        ("Hello STOP", ["STOP"], 10),  # a whole stop string is find_stop's business
        ("Hello", ["lo!", "o!"], 3),  # the longest held suffix wins
        ("Hello", [], 5),
        ("ab", ["abcdef"], 0),
        ("x\n", ["\n\n"], 1),
    ],
)
def test_safe_text_len(text, stop, safe):
    assert safe_text_len(text, stop) == safe


@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_shows_a_hidden_stop_string(byte_bpe, include):
    stop = ["</answer>", "🙂"]
    ids = byte_bpe.encode("the answer is 42 </answer> café").ids
    detokenizer = IncrementalDetokenizer(byte_bpe, byte_bpe.encode("hello").ids)
    streamed, final = "", None
    for token in ids:
        delta = detokenizer.add(token)
        hit = find_stop(detokenizer.text, stop, len(delta))
        if hit:
            final = truncate_at_stop(detokenizer.text, *hit, include)
            break
        ready = detokenizer.text[: safe_text_len(detokenizer.text, stop)]
        assert ready.startswith(streamed)
        streamed = ready
    assert final == "the answer is 42 " + ("</answer>" if include else "")
    assert final.startswith(streamed) and "<" not in streamed

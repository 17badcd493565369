"""hh-rlhf transcripts, on real rows of the file the examples ship: parsed into chats with the prompt split off."""

from __future__ import annotations

import itertools
from pathlib import Path

from posttrain.data.config import DataConfig
from posttrain.data.dataset import read_examples
from posttrain.data.formats import Preference, detect_format
from posttrain.data.readers import read_rows

HH = Path(__file__).resolve().parents[2] / "examples" / "data" / "hh-rlhf" / "harmless-pairs.jsonl.gz"


def as_transcript(messages) -> str:
    names = {"user": "Human", "assistant": "Assistant"}
    return "".join(f"\n\n{names[m['role']]}: {m['content']}" for m in messages)


def squash(text: str) -> str:
    return " ".join(text.split())


def test_real_rows_parse_into_prompt_and_answers():
    rows = list(itertools.islice(read_rows(HH), 300))
    assert detect_format(rows[0][1]) == "hh_rlhf"
    loaded = read_examples(DataConfig(path=str(HH), max_rows=300))
    assert loaded.format == "hh_rlhf" and loaded.rows_read == 300
    assert len(loaded.examples) + len(loaded.bad) == 300 and len(loaded.examples) >= 290
    originals = {f"{HH}:{n}": row for n, row in rows}
    multi_turn = 0
    for where, example in loaded.examples:
        assert isinstance(example, Preference)
        assert example.prompt[-1]["role"] == "user"
        assert example.chosen[0]["role"] == "assistant" and example.rejected[0]["role"] == "assistant"
        multi_turn += len(example.prompt) > 1
        # prompt + answer written back as a transcript is the original (up to whitespace)
        original = originals[where]
        assert squash(as_transcript(example.prompt + example.chosen)) == squash(original["chosen"])
        assert squash(as_transcript(example.prompt + example.rejected)) == squash(original["rejected"])
    assert multi_turn > 50  # the shared prefix really is multi-turn on many rows


def test_real_bad_rows_are_reported_with_their_line():
    loaded = read_examples(DataConfig(path=str(HH), max_rows=300, max_bad_row_fraction=0.5))
    for bad in loaded.bad.rows:  # e.g. two Assistant turns in a row, or an empty last answer
        assert bad.location.startswith(f"{HH}:")
        assert "roles do not alternate" in bad.reason or "empty" in bad.reason

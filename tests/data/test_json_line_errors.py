"""Every JSONL reader in the tree reports a bad line alike: `file:line:column: reason`, the column within
that line (not "column 1" of the next one), and an undecodable byte as one error, never a traceback."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posttrain.commands.generate import read_prompts_file
from posttrain.data.readers import read_rows
from posttrain.errors import PosttrainError
from posttrain.eval.perplexity import read_texts
from posttrain.eval.prompts import file_rows
from posttrain.rollout.prompts import DatasetPrompts
from posttrain.tasks.gsm8k import load_gsm8k
from posttrain.trainers.rl.config import DataSection

GOOD = b'{"prompt": "p", "question": "q", "answer": "#### 1", "text": "t"}\n'


def _jsonl_prompts(path: Path) -> Any:
    return DatasetPrompts(DataSection(task=None, path=str(path), eval_size=0))


READERS: dict[str, Callable[[Path], Any]] = {
    "read_rows": lambda path: list(read_rows(path)),
    "gsm8k": load_gsm8k,
    "rl prompts": _jsonl_prompts,
    "generate --prompts-file": read_prompts_file,
    "eval prompts": file_rows,
    "eval perplexity": lambda path: read_texts(path, "text"),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize(
    "bad_line, at, reason",
    [
        # cut short: blamed just after its last character, on its own line
        (b'{"prompt": "p", "question": "q"\n', "3:32", "invalid JSON: Expecting ',' delimiter"),
        (b'{"prompt": "p" "question": "q"}\n', "3:16", "invalid JSON: Expecting ',' delimiter"),
        (b'{"prompt": "p\xff"}\n', "3:14", "invalid UTF-8 (byte 0xff)"),
    ],
)
def test_a_bad_line_is_one_error_at_its_line_and_column(tmp_path, reader, bad_line, at, reason):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(GOOD * 2 + bad_line + GOOD * 2)
    with pytest.raises(PosttrainError, match=rf"^{re.escape(f'{path}:{at}: {reason}')}$"):
        READERS[reader](path)

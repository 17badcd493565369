"""Perplexity: equal to exp(mean NLL) computed by hand, independent of batching, and its input errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError
from posttrain.eval.perplexity import evaluate_perplexity, perplexity, read_texts, tokenize_texts
from tests.quant.tiny import char_tokenizer, tiny_model

ROWS = [[1, 5, 9, 3, 7], [1, 4], [1, 8, 8, 8, 2, 6, 9], [1], [1, 3, 3]]


def nll_by_hand(model, rows):
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            if len(row) < 2:
                continue
            ids = torch.tensor([row])
            logprobs = F.log_softmax(model(ids)[0, :-1].double(), dim=-1)  # (T-1, V)
            total -= logprobs.gather(1, ids[0, 1:, None]).sum().item()
            count += len(row) - 1
    return total, count


def test_perplexity_is_exp_of_mean_nll_by_hand():
    model = tiny_model()
    total, count = nll_by_hand(model, ROWS)
    result = perplexity(model, ROWS, batch_size=2)
    assert (result.tokens, result.rows) == (count, 5) == (4 + 1 + 6 + 0 + 2, 5)
    assert result.mean_nll == pytest.approx(total / count, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_batch_size_does_not_change_the_result():
    model = tiny_model(seed=3)
    one, all_at_once = perplexity(model, ROWS, batch_size=1), perplexity(model, ROWS, batch_size=8)
    assert one.mean_nll == pytest.approx(all_at_once.mean_nll, rel=1e-5) and one.tokens == all_at_once.tokens


def test_evaluate_reads_a_column_skips_and_cuts(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"question": "q", "answer": text})
            for text in ["first row", "ab", "a longer third row", "fourth"]
        )
        + "\n"
    )
    model, tokenizer = tiny_model(), char_tokenizer()
    result = evaluate_perplexity(model, tokenizer, data, column="answer", skip=1, max_rows=2, max_length=6)
    rows = [tokenizer.encode(t, add_special_tokens=True)[:6] for t in ["ab", "a longer third row"]]
    assert (result.rows, result.truncated_rows, result.tokens) == (2, 1, 2 + 5)
    assert result.mean_nll == pytest.approx(perplexity(model, rows).mean_nll, rel=1e-6)


def test_input_errors(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"answer": "fine"}\n{"question": "no answer"}\n{"answer": 3}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:2: no column 'answer' \(columns: question\)"):
        read_texts(data, "answer")
    with pytest.raises(DataError, match=r"rows.jsonl:3: column 'answer' is int, expected text"):
        read_texts(data, "answer", skip=2)
    with pytest.raises(DataError, match=r"no rows to score \(skip=10"):
        read_texts(data, "answer", skip=10)
    with pytest.raises(DataError, match="no such file"):
        read_texts(tmp_path / "missing.jsonl", "answer")
    with pytest.raises(PosttrainError, match="max_length must be >= 2"):
        tokenize_texts(char_tokenizer(), ["x"], 1)
    with pytest.raises(PosttrainError, match="no tokens to score"):
        perplexity(tiny_model(), [[1], [2]])
    with pytest.raises(PosttrainError, match="batch_size must be >= 1"):
        perplexity(tiny_model(), ROWS, batch_size=0)

"""SamplingParams.logits_processors (vLLM's): each sequence's raw logits row goes through them before it is drawn
from, on every step (chained decode steps and speculative drafts step aside for such a sequence), and the logprobs
reported are of the processed distribution; a bad value is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import SamplingParams
from tests.engine.tiny import EOS, make_llm, tiny_model

PROMPTS = ["123", "45678"]


def only(allowed: list[int]):  # noqa: ANN201
    """A processor that keeps `allowed` and records what it was called with."""
    calls: list[list[int]] = []

    def process(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        calls.append(list(output_token_ids))
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    process.calls = calls
    return process


@pytest.mark.parametrize("fields", [{"decode_steps": 4}, {"speculative": {"method": "ngram", "num_tokens": 3}}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_step_is_processed(fields: dict, temperature: float) -> None:
    llm = make_llm(tiny_model(), **fields)
    allowed = [40, 41, 42]
    process = only(allowed)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=12, logits_processors=[process])
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        sample = out.outputs[0]
        assert len(sample.token_ids) == 12 and set(sample.token_ids) <= set(allowed)
    assert len(process.calls) == 2 * 12  # once per drawn token, with the sample's output so far
    assert sorted(len(c) for c in process.calls) == sorted(list(range(12)) * 2)


def test_logprobs_are_the_processed_distributions() -> None:
    plain = make_llm(tiny_model(), decode_steps=1)
    banned = plain.generate(["123"], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0].outputs[0]
    top = [t for t, _ in banned.top_logprobs[0]]
    keep = top[1:]  # the argmax is masked away: the next most likely is drawn, with its renormalised logprob
    got = plain.generate(
        ["123"], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, logits_processors=[only(keep)])
    )[0].outputs[0]
    assert got.token_ids == [keep[0]]
    values = dict(banned.top_logprobs[0])
    expected = values[keep[0]] - torch.logsumexp(torch.tensor([values[t] for t in keep]), 0).item()
    assert abs(got.logprobs[0] - expected) < 1e-5
    assert got.token_ids[0] != EOS


def test_bad_processors_are_refused() -> None:
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[1])

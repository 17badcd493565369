"""A deterministic stand-in for the engine: canned completions per prompt, so counts are known by hand."""

from __future__ import annotations

from typing import Any

from posttrain.engine import SamplingParams
from posttrain.engine.outputs import CompletionOutput, RequestOutput


class FakeLLM:
    """`generate` answers prompt p (its last message's content) with completions[p][0..n-1]."""

    def __init__(self, completions: dict[str, list[str]]) -> None:
        self.completions = completions
        self.calls: list[tuple[int, SamplingParams, bool]] = []

    def generate(self, prompts: list[Any], params: SamplingParams, use_tqdm: bool = False) -> list[RequestOutput]:
        self.calls.append((len(prompts), params, use_tqdm))
        outputs = []
        for i, prompt in enumerate(prompts):
            texts = self.completions[prompt[-1]["content"]]
            samples = [
                CompletionOutput(j, texts[j], list(range(len(texts[j]))), finish_reason="stop", policy_version=0)
                for j in range(params.n)
            ]
            outputs.append(RequestOutput(f"fake-{i}", None, [1, 2, 3], samples, finished=True))
        return outputs


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]

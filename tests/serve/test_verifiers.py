"""A verifiers MultiTurnEnv driven against a local `posttrain serve` on loopback (docs/agents.md "verifiers
environments"): its episodes carry the server's token ids and logprobs, they become samples with the environment's
turns at mask 0 (where a second turn continues its first), the sampled logprobs equal the training model's own (fp32 on both sides), and a GRPO step trains
on them. Skipped unless the `verifiers` extra (0.1.x) is installed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

vf = pytest.importorskip("verifiers", minversion="0.1.14")
datasets = pytest.importorskip("datasets")

from posttrain.algos.logprobs import token_logprobs  # noqa: E402
from posttrain.engine import EngineConfig  # noqa: E402
from posttrain.rollout.served_episodes import samples_from_verifiers  # noqa: E402
from posttrain.tokenizer import Tokenizer  # noqa: E402
from posttrain.trainers.episode_grpo import grpo_update  # noqa: E402
from tests.serve.conftest import running, tiny_model  # noqa: E402

MODEL = "tiny-vf"
KEY_VAR = "POSTTRAIN_TEST_KEY"


class Again(vf.MultiTurnEnv):
    """Each model turn is answered with one user message, until max_turns."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="again")]


def reply_length(completion, **kwargs) -> float:
    return float(sum(len(m["content"] or "") for m in completion if m["role"] == "assistant"))


@pytest.fixture(scope="module")
def served(default_model_dir: Path) -> Iterator[tuple[str, Tokenizer]]:
    from posttrain.serve.app import build_app
    from posttrain.serve.loading import build_served_models

    tokenizer = Tokenizer.from_dir(default_model_dir)
    config = EngineConfig(compute_dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    engine = build_served_models(tiny_model(tokenizer), tokenizer, MODEL, None, config)
    with running(build_app(engine, tokenizer)) as base_url:
        yield base_url + "/v1", tokenizer


def test_verifiers_episodes_train_grpo(served, monkeypatch: pytest.MonkeyPatch) -> None:
    api, tokenizer = served
    monkeypatch.setenv(KEY_VAR, "unused")
    rows = datasets.Dataset.from_list([{"question": "hi", "answer": ""}, {"question": "count", "answer": ""}])
    env = Again(dataset=rows, rubric=vf.Rubric(funcs=[reply_length]), max_turns=2)
    client = vf.ClientConfig(api_base_url=api, api_key_var=KEY_VAR, max_retries=0)
    sampling = {"max_tokens": 8, "temperature": 1.0, "logprobs": True, "extra_body": {"return_token_ids": True}}
    results = asyncio.run(
        env.evaluate(client, MODEL, sampling_args=sampling, rollouts_per_example=2, state_columns=["trajectory"])
    )
    outputs = results["outputs"]
    assert len(outputs) == 4 and all(len(o["trajectory"]) == 2 for o in outputs)

    samples = samples_from_verifiers(outputs)
    sampled = sum(len(step["tokens"]["completion_ids"]) for o in outputs for step in o["trajectory"])
    assert sum(s.num_model_tokens for s in samples) == sampled  # every sampled token, and only those, trained
    assert {s.group for s in samples} == {0, 1}

    model = tiny_model(tokenizer)  # the served weights (tiny_model is seeded)
    for sample in samples:
        with torch.no_grad():
            logits = model(torch.tensor([sample.ids]))[:, :-1]
            own = token_logprobs(logits, torch.tensor([sample.ids[1:]]))[0, len(sample.prompt_ids) - 1 :]
        mask = torch.tensor(sample.completion_mask, dtype=torch.bool)
        # fp32 on both sides; logprobs of logits up to |z| ~ 30: a few ulps of 30 (eps32 * 30 * 8 ~ 3e-5)
        served_lp = torch.tensor(sample.logprobs)
        torch.testing.assert_close(served_lp[mask], own[mask], rtol=0, atol=torch.finfo(torch.float32).eps * 30 * 8)

    metrics = grpo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), samples)
    assert metrics["abs_log_ratio"] < 1e-4 and metrics["model_tokens"] == sampled
    assert torch.isfinite(torch.tensor(metrics["loss"]))

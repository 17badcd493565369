"""Group generation: n samples of each prompt from one engine call over the live policy module."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from posttrain.engine import LLM, RequestOutput, SamplingParams
from posttrain.rollout.batch import PROMPT_KEY, RolloutBatch

EngineCall = Callable[[], AbstractContextManager[None]]  # a context around one engine call: `Parallel.rollout`'s
# generate_groups' signature (llm, rows, params, seeds, lockstep=...): single-turn groups, or episodes'
GroupGenerator = Callable[..., RolloutBatch]


def generate_groups(
    llm: LLM,
    rows: list[dict[str, Any]],
    params: SamplingParams,
    seeds: list[int] | None = None,
    use_tqdm: bool = False,
    lockstep: EngineCall = nullcontext,
) -> RolloutBatch:
    """n = params.n samples of each row's prompt from the engine, with their sampling logprobs; with `seeds`,
    row i's request is seeded with seeds[i] (its samples then depend on nothing else: not on the batch).
    `use_tqdm`: the engine's progress bar over the prompts. `lockstep`: the engine call runs inside it (under
    torchrun with `dist.rollout_weights=per_layer`, every rank's call together)."""
    with lockstep():
        outputs = llm.generate([row[PROMPT_KEY] for row in rows], seeded_params(params, seeds), use_tqdm=use_tqdm)
    return groups_batch(rows, params, outputs)


def seeded_params(params: SamplingParams, seeds: list[int] | None) -> SamplingParams | list[SamplingParams]:
    """One SamplingParams for every row, or with `seeds` row i's seeded with seeds[i]."""
    return params if seeds is None else [replace(params, seed=seed) for seed in seeds]


def groups_batch(rows: list[dict[str, Any]], params: SamplingParams, outputs: list[RequestOutput]) -> RolloutBatch:
    """The engine's outputs of `rows` (one request of params.n samples each, in order) as a rollout batch."""
    completion_ids, texts, logprobs, reasons, versions, token_versions = [], [], [], [], [], []
    for output in outputs:
        for sample in output.outputs:
            completion_ids.append(list(sample.token_ids))
            texts.append(sample.text)
            logprobs.append(list(sample.logprobs or []))
            reasons.append(sample.finish_reason or "length")
            versions.append(sample.policy_version if sample.policy_version is not None else -1)
            token_versions.append(list(sample.token_policy_versions))
    return RolloutBatch(
        group_size=params.n,
        rows=list(rows),
        prompt_ids=[list(o.prompt_token_ids) for o in outputs],
        completion_ids=completion_ids,
        texts=texts,
        rollout_logprobs=logprobs,
        finish_reasons=reasons,
        policy_versions=versions,
        token_versions=token_versions,
    )

"""Prompt logprobs against a plain forward pass (log_softmax of the logits at t - 1, gathered at token t),
through batching, chunked prefill, the prefix cache, n > 1 and preemption; prefill-only requests. (Bad
values are in test_sampling.py's validation table.)"""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import EngineConfig, LLMEngine, SamplingParams
from posttrain.errors import PosttrainError
from posttrain.models.transformer import Transformer
from tests.engine.tiny import VOCAB, CharTokenizer, make_llm, tiny_model
from tests.numeric import assert_reordered

PROMPTS = [[5], [1, 2, 3], list(range(10, 27)), [7] * 9, list(range(40, 8, -1)), [3, 1, 4, 1, 5, 9, 2, 6]]
LONG = [(7 * i + 3) % 60 for i in range(61)]  # longer than max_num_batched_tokens=24: prefilled in 3 chunks


def dense_log_softmax(model: Transformer, prompt: list[int]) -> torch.Tensor:
    """(P - 1, V): row t - 1 is the raw distribution that predicts prompt token t."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt]))[0, :-1].float(), dim=-1)


def assert_prompt_logprobs(model: Transformer, prompt: list[int], entries: list[float | None] | None) -> None:
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    expected = dense_log_softmax(model, prompt).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(entries[1:], dtype=torch.float32), expected, atol=1e-4, rtol=0)


def test_a_batch_of_prompts_of_different_lengths() -> None:
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=0)
    outs = llm.generate(PROMPTS + [LONG], params)
    for prompt, out in zip(PROMPTS + [LONG], outs):
        assert_prompt_logprobs(llm.engine.model, prompt, out.prompt_logprobs)
        assert out.prompt_top_logprobs is None
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_generation_is_unchanged_and_off_by_default() -> None:
    llm = make_llm()
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=8, logprobs=True, seed=5))
    scored = llm.generate(
        PROMPTS, SamplingParams(temperature=0.8, max_tokens=8, logprobs=True, seed=5, prompt_logprobs=2)
    )
    for a, b in zip(plain, scored):
        assert a.prompt_logprobs is None and a.prompt_top_logprobs is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(b.outputs[0].logprobs), torch.tensor(a.outputs[0].logprobs))


def test_chunked_prefill_accumulates_every_chunk() -> None:
    llm = make_llm()  # max_num_batched_tokens=24
    out = llm.generate([LONG], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert llm.stats()["steps"] >= 3  # the prompt alone took three steps
    assert_prompt_logprobs(llm.engine.model, LONG, out.prompt_logprobs)


def test_top_k_alternatives_equal_torch_topk() -> None:
    llm = make_llm()
    for k in (3, VOCAB + 10):  # more than the vocabulary: all of it
        out = llm.generate([LONG], SamplingParams(max_tokens=1, prompt_logprobs=k))[0]
        assert_prompt_logprobs(llm.engine.model, LONG, out.prompt_logprobs)
        top = out.prompt_top_logprobs
        assert len(top) == len(LONG) and top[0] is None
        values, ids = dense_log_softmax(llm.engine.model, LONG).topk(min(k, VOCAB), dim=-1)  # (P - 1, k)
        assert [[t for t, _ in step] for step in top[1:]] == ids.tolist()
        got = torch.tensor([[lp for _, lp in step] for step in top[1:]])
        torch.testing.assert_close(got, values, atol=1e-4, rtol=0)


def test_each_prompt_token_has_its_rank_by_logit() -> None:
    """rank = 1 + the tokens the model finds more likely; the top-1 alternative has rank 1."""
    llm = make_llm()
    assert llm.generate([LONG], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprob_ranks is None
    out = llm.generate([LONG], SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprob_ranks=True))[0]
    ranks = out.prompt_logprob_ranks
    assert len(ranks) == len(LONG) and ranks[0] is None
    dense = dense_log_softmax(llm.engine.model, LONG)  # (P - 1, V)
    mine = dense.gather(1, torch.tensor(LONG[1:])[:, None])  # (P - 1, 1)
    assert ranks[1:] == ((dense > mine).sum(-1) + 1).tolist()
    for token, rank, top in zip(LONG[1:], ranks[1:], out.prompt_top_logprobs[1:]):
        assert (rank == 1) == (top[0][0] == token)
    assert 1 in ranks[1:] and max(ranks[1:]) > 1  # both cases occur in this prompt


def test_prefix_cache_hits_never_skip_positions_that_need_logprobs() -> None:
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    llm.generate([LONG], SamplingParams(temperature=0, max_tokens=2))  # fills the prefix cache
    first, second = llm.generate([LONG], params)[0], llm.generate([LONG], params)[0]
    for out in (first, second):
        assert out.num_cached_tokens == 0  # the cached blocks were there; taking them would skip their logits
        assert_prompt_logprobs(llm.engine.model, LONG, out.prompt_logprobs)
    assert [[t for t, _ in step] for step in second.prompt_top_logprobs[1:]] == [
        [t for t, _ in step] for step in first.prompt_top_logprobs[1:]
    ]
    # A request without prompt logprobs still reuses the blocks the scoring requests published.
    assert llm.generate([LONG], SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens == 60


def test_n_samples_share_one_set_computed_once() -> None:
    llm = make_llm(enable_prefix_caching=False)
    out = llm.generate(
        [LONG], SamplingParams(n=4, temperature=1.0, max_tokens=3, ignore_eos=True, seed=1, prompt_logprobs=2)
    )[0]
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 3 for o in out.outputs)
    assert_prompt_logprobs(llm.engine.model, LONG, out.prompt_logprobs)
    assert len(out.prompt_top_logprobs) == len(LONG)
    assert llm.stats()["processed_tokens"] == len(LONG) + 4 * (3 - 1)  # the prompt went through once


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_neither_duplicates_nor_loses_entries(prefix_caching: bool) -> None:
    prompts = PROMPTS + [LONG[:40]]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=14, seed=2, ignore_eos=True, prompt_logprobs=1)
    tight = make_llm(num_kv_blocks=16, watermark=0.0, enable_prefix_caching=prefix_caching)
    outs = tight.generate(prompts, params)
    assert tight.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(tight.engine.model, prompt, out.prompt_logprobs)
        assert len(out.prompt_top_logprobs) == len(prompt)
    assert tight.engine.num_free_blocks == tight.engine.num_blocks


def test_preempted_mid_prefill_reuses_only_positions_it_has() -> None:
    engine = LLMEngine(
        tiny_model(),
        CharTokenizer(),
        EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=24),
    )
    engine.add_request("r", LONG, SamplingParams(max_tokens=1, prompt_logprobs=0))
    engine.step()  # the first chunk: tokens 0..23, so the logprobs of tokens 1..24
    engine.scheduler.preempt_all()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert engine.stats()["prefix_cache_hit_tokens"] == 24  # the chunk's blocks, whose logprobs it holds
    assert_prompt_logprobs(engine.model, LONG, outputs[0].prompt_logprobs)


def test_max_tokens_zero_prefills_only() -> None:
    llm = make_llm(max_model_len=40)
    prompt = LONG[:40]  # fills max_model_len: fine when nothing is generated
    out = llm.generate([prompt], SamplingParams(n=2, max_tokens=0, prompt_logprobs=0))[0]
    assert [(o.token_ids, o.text, o.finish_reason) for o in out.outputs] == [([], "", "length")] * 2
    assert out.finished and out.policy_version == 0
    assert_prompt_logprobs(llm.engine.model, prompt, out.prompt_logprobs)
    assert llm.stats()["generated_tokens"] == 0 and llm.engine.num_free_blocks == llm.engine.num_blocks
    with pytest.raises(PosttrainError, match="max_model_len"):
        llm.generate([prompt], SamplingParams(max_tokens=1))
    with pytest.raises(PosttrainError, match="longer than max_model_len"):
        llm.generate([prompt + [1]], SamplingParams(max_tokens=0))


def test_entries_from_a_later_token_skip_the_earlier_ones() -> None:
    llm = make_llm()
    full = llm.generate([LONG], SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logprob_ranks=True))[0]
    for start in (1, 2, 30, len(LONG) - 1, len(LONG), len(LONG) + 5):
        out = llm.generate(
            [LONG],
            SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logprobs_from=start, prompt_logprob_ranks=True),
        )[0]
        skipped = min(start, len(LONG))
        for got in (out.prompt_logprobs, out.prompt_logprob_ranks):
            assert len(got) == len(LONG) and got[:skipped] == [None] * skipped
        assert out.prompt_logprob_ranks[skipped:] == full.prompt_logprob_ranks[skipped:]
        # Prefilled in other chunks (other batch shapes): the same logprobs up to the sums' order.
        if skipped < len(LONG):
            assert_reordered(torch.tensor(out.prompt_logprobs[skipped:]), torch.tensor(full.prompt_logprobs[skipped:]))
        assert [[t for t, _ in top] for top in out.prompt_top_logprobs[skipped:]] == [
            [t for t, _ in top] for top in full.prompt_top_logprobs[skipped:]
        ]


def test_a_shared_prompt_comes_from_the_prefix_cache_when_only_completions_are_scored() -> None:
    """A chosen / rejected pair: the same 40-token prompt, two completions. Scored from the completion on,
    the second request takes the prompt's blocks from the cache, all but the last (block_size 4): its last
    position's logits predict the first completion token. Scored from token 1, it can take none."""
    prompt = LONG[:40]
    chosen, rejected = prompt + [1, 2, 3, 4, 5], prompt + [9, 8, 7]
    for first, cached in ((len(prompt), 36), (1, 0)):
        llm = make_llm()
        params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_from=first)
        outs = [llm.generate([ids], params)[0] for ids in (chosen, rejected)]
        assert outs[1].num_cached_tokens == cached
        for ids, out in zip((chosen, rejected), outs):
            assert out.prompt_logprobs[:first] == [None] * first
            dense = dense_log_softmax(llm.engine.model, ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(out.prompt_logprobs[first:]), dense[first - 1 :], atol=1e-4, rtol=0)
        assert llm.engine.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt_logprobs": 0, "prompt_logprobs_from": 0}, "prompt_logprobs_from must be an integer >= 1"),
        ({"prompt_logprobs_from": 3}, "prompt_logprobs_from must be 1 unless prompt_logprobs is set"),
        ({"prompt_logprob_ranks": True}, "prompt_logprob_ranks must be a bool, and False unless prompt_logprobs"),
        ({"prompt_logprobs": 0, "prompt_logprob_ranks": 1}, "prompt_logprob_ranks must be a bool"),
    ],
)
def test_bad_prompt_logprobs_from_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)

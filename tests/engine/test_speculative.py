"""Speculative decoding (posttrain/engine/speculative): greedy outputs token for token those of the plain engine,
sampled tokens from the target's distribution (a frequency test with a bound derived from the sample count, shown
to catch a wrong residual distribution), the target's logprobs, blocks given back, the n-gram index, the config."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from posttrain.engine import EngineConfig, LLMEngine, SamplingParams
from posttrain.engine.speculative import acceptance
from posttrain.engine.speculative.acceptance import verify_drafts, verify_greedy_drafts
from posttrain.engine.speculative.draft_length import DraftLength
from posttrain.engine.speculative.ngram import NgramIndex
from posttrain.errors import PosttrainError
from posttrain.trainers.distill_student import keep_layers
from tests.engine.test_engine import PROMPTS, dense_logprobs
from tests.engine.tiny import VOCAB, CharTokenizer, make_llm, tiny_model

# tiny_model(2) wanders over many tokens greedily; tiny_model(0) falls into repeating 46 (n-gram drafts shine).
VARIED, LOOPING = 2, 0
REPEATING_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


# The checking machinery's tests check every proposal whole (adaptive off): they need drafts, accepted and rejected.
def ngram(**fields) -> dict:
    return {"method": "ngram", "num_tokens": 4, "adaptive": False, **fields}


def draft(**fields) -> dict:
    return {"method": "draft", "num_tokens": 3, "adaptive": False, **fields}


def sharpened(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """A draft model that is the target with its logits scaled: near a point mass where the target is spread."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.lm_head.weight.mul_(factor)
    return copied


def token_ids(outputs) -> list[list[int]]:
    return [sample.token_ids for out in outputs for sample in out.outputs]


# ---- greedy: identical to the plain engine ------------------------------------------------------------------


GREEDY_PARAMS = [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0, max_tokens=7),  # max_tokens caps the drafts
    SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),  # the history includes the drafts
    SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[46]),
    SamplingParams(temperature=0, max_tokens=20, stop=["^^"], logprobs=2),
]


@pytest.mark.parametrize(
    ("seed", "method", "cpu_kernels", "adaptive"),
    [
        (VARIED, "ngram", True, False),
        (LOOPING, "ngram", False, False),
        (VARIED, "draft", True, False),
        (LOOPING, "draft", True, False),
        (VARIED, "ngram", True, True),
        (LOOPING, "draft", True, True),
    ],
)
def test_greedy_outputs_are_the_plain_engines(
    seed: int, method: str, cpu_kernels: bool, adaptive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every prompt under every setting of GREEDY_PARAMS in one batch, and the first few prompts one at a time.
    Adaptive: a draft row costs 0.01 of a step whatever the clock says, so that in this batch of 30 sequences a draft
    is checked while its expected gain stays above ~0.3 tokens (under the measured cost, a tiny model's row costs
    about a whole step, and under the untimed guess a 30-sequence step's row costs about a token: nothing would be
    checked)."""
    if adaptive:
        monkeypatch.setattr(DraftLength, "step_cost", lambda self, num_seqs, rows: 1.0 + 0.01 * rows)
    model = tiny_model(seed)
    prompts = [p for p in [*PROMPTS, REPEATING_PROMPT] for _ in GREEDY_PARAMS]
    params = GREEDY_PARAMS * (len(PROMPTS) + 1)
    plain = make_llm(model, cpu_kernels=cpu_kernels, max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512)
    if method == "ngram":
        spec_fields = {"speculative": ngram(adaptive=adaptive)}
    else:  # the layer-dropped student, as `posttrain convert --num-layers 1` would write it
        spec_fields = {"speculative": draft(adaptive=adaptive), "draft_model": keep_layers(model, [0])}
    spec = make_llm(
        model, cpu_kernels=cpu_kernels, max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512, **spec_fields
    )
    expected = plain.generate(prompts, params)
    batched = spec.generate(prompts, params)
    one_by_one = [spec.generate([p], sp)[0] for p, sp in zip(prompts[:5], params[:5])]
    assert token_ids(batched) == token_ids(expected)
    assert token_ids(one_by_one) == token_ids(expected[:5])
    for got, want, sp in zip([*batched, *one_by_one], [*expected, *expected[:5]], [*params, *params[:5]]):
        assert [s.text for s in got.outputs] == [s.text for s in want.outputs]
        assert [s.finish_reason for s in got.outputs] == [s.finish_reason for s in want.outputs]
        if sp.logprobs:
            torch.testing.assert_close(got.outputs[0].logprobs, want.outputs[0].logprobs, atol=1e-4, rtol=0)
            assert [[t for t, _ in top] for top in got.outputs[0].top_logprobs] == [
                [t for t, _ in top] for top in want.outputs[0].top_logprobs
            ]
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0  # speculation did happen
    assert stats["free_kv_blocks"] == stats["kv_blocks"]


def test_ngram_drafts_are_accepted_where_the_output_repeats() -> None:
    llm = make_llm(tiny_model(LOOPING), speculative=ngram())
    out = llm.generate([REPEATING_PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stats = llm.stats()
    assert len(out.outputs[0].token_ids) == 40
    assert stats["spec_acceptance_rate"] > 0.8  # the model repeats one token: every lookup hits
    assert stats["spec_mean_accepted_length"] > 3
    assert stats["steps"] < 20  # 40 tokens in far fewer steps than 40 (1 prefill + checks of 4 drafts)


def test_a_draft_model_equal_to_the_target_is_always_accepted() -> None:
    model = tiny_model(VARIED)
    llm = make_llm(model, speculative=draft(num_tokens=4), draft_model=copy.deepcopy(model))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.stats()["spec_acceptance_rate"] == 1.0


# ---- blocks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_rejected_positions_give_their_blocks_back(method: str) -> None:
    model = tiny_model(VARIED)
    config = EngineConfig(block_size=2, num_kv_blocks=200, max_num_seqs=8, max_num_batched_tokens=32)
    config.speculative = ngram(num_tokens=6) if method == "ngram" else draft(num_tokens=6)
    config.validate()
    engine = LLMEngine(
        model, CharTokenizer(), config, draft_model=keep_layers(model, [1]) if method == "draft" else None
    )
    for i, prompt in enumerate([*PROMPTS, REPEATING_PROMPT]):
        params = SamplingParams(n=2, temperature=0.8, max_tokens=24, seed=i, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    bm = engine.block_manager
    rejections = 0
    while engine.has_unfinished_requests():
        before = engine.stats()
        engine.step()
        after = engine.stats()
        rejections += (after["spec_draft_tokens"] - before["spec_draft_tokens"]) - (
            after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        )
        for seq in engine.scheduler.running:  # no block past the sequence's tokens survives a step
            assert len(seq.block_table) <= bm.blocks_for_tokens(seq.num_tokens)
            assert not seq.draft_token_ids
    assert rejections > 0
    assert bm.num_free_blocks == bm.num_blocks
    if method == "draft":
        assert engine.speculator.proposer.block_manager.num_free_blocks == engine.num_blocks


# ---- sampling: the target's distribution ---------------------------------------------------------------------


def exact_token_distributions(model: torch.nn.Module, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """The target's distributions of the 2nd and 3rd sampled tokens (summed over the tokens before), fp64 (V,)."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt]))[0, -1].double() / temperature, -1)  # (V,)
        two = torch.tensor([prompt + [a] for a in range(VOCAB)])
        second = torch.softmax(model(two)[:, -1].double() / temperature, -1)  # (V, V): p(t2 | t1)
        three = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        third = torch.softmax(model(three)[:, -1].double() / temperature, -1).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None] * second  # (V, V): p(t1, t2)
    return [joint.sum(0), torch.einsum("ab,abc->c", joint, third)]


def frequency_bound(p: torch.Tensor, samples: int, tests: int, delta: float = 1e-9) -> torch.Tensor:
    """How far the frequency of each token among `samples` independent draws from p may fall from p_i: Bernstein's
    inequality for a binomial mean, |f_i - p_i| <= sqrt(2 p_i (1 - p_i) L / n) + 2 L / (3 n), with L = ln(2 V m /
    delta), holds for all V tokens of all m tested distributions at once with probability >= 1 - delta. (V,)"""
    log_term = math.log(2 * p.numel() * tests / delta)
    return (2 * p * (1 - p) * log_term / samples).sqrt() + 2 * log_term / (3 * samples)


def worst_frequency_ratio(llm, model, prompt: list[int], temperature: float, samples: int = 2000) -> float:
    """The largest |frequency - p| / bound over the 2nd and 3rd tokens of `samples` independent samples (> 1:
    the samples do not come from the target). Requests of 500 samples each, seeds that never overlap."""
    per_request = 500
    params = [
        SamplingParams(n=per_request, temperature=temperature, max_tokens=3, ignore_eos=True, seed=i * per_request)
        for i in range(samples // per_request)
    ]
    tokens = torch.tensor(token_ids(llm.generate([prompt] * len(params), params)))  # (samples, 3)
    ratios = []
    for position, p in zip((1, 2), exact_token_distributions(model, prompt, temperature)):
        frequency = torch.bincount(tokens[:, position], minlength=VOCAB).double() / samples
        ratios.append(float(((frequency - p).abs() / frequency_bound(p, samples, tests=2)).max()))
    return max(ratios)


def sampling_llm(method: str, model: torch.nn.Module, draft_model: torch.nn.Module | None = None):
    spec = ngram(num_tokens=3) if method == "ngram" else draft(num_tokens=3)
    return make_llm(
        model,
        speculative=spec,
        draft_model=draft_model,
        max_num_seqs=2000,
        max_num_batched_tokens=8000,
        num_kv_blocks=8000,
    )


# (method, target seed, prompt, temperature, draft): the looping model at temperature 3 puts about half its mass
# on the repeated token, which the n-gram and the sharpened draft propose: rejections are frequent and the
# residual decides the rest. The layer-dropped student spreads its own mass (q far from a point mass).
SAMPLING_CASES = {
    "ngram": ("ngram", LOOPING, [46] * 8, 3.0, None),
    "draft-sharp": ("draft", LOOPING, [46] * 8, 3.0, lambda m: sharpened(m, 4.0)),
    "draft-student": ("draft", VARIED, REPEATING_PROMPT, 1.0, lambda m: keep_layers(m, [1])),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampled_tokens_follow_the_target_distribution(case: str) -> None:
    method, seed, prompt, temperature, make_draft = SAMPLING_CASES[case]
    model = tiny_model(seed)
    llm = sampling_llm(method, model, make_draft(model) if make_draft else None)
    assert worst_frequency_ratio(llm, model, prompt, temperature) <= 1.0
    stats = llm.stats()
    assert 0.2 < stats["spec_acceptance_rate"] < 0.95  # both outcomes of the acceptance test happen often


@pytest.mark.parametrize("case", ["ngram", "draft-sharp"])
def test_the_frequency_test_catches_a_wrong_residual(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deliberate bug: after a rejection, draw from the target's distribution instead of max(0, p - q). The
    rejected draft then comes out too often; the test above must fail."""
    monkeypatch.setattr(acceptance, "residual_distribution", lambda target, draft: target)
    method, seed, prompt, temperature, make_draft = SAMPLING_CASES[case]
    model = tiny_model(seed)
    llm = sampling_llm(method, model, make_draft(model) if make_draft else None)
    assert worst_frequency_ratio(llm, model, prompt, temperature) > 1.0


def test_the_acceptance_rule_keeps_the_target_distribution_at_every_position() -> None:
    """verify_drafts alone, 100k independent trials: drafts drawn from q, the token at position i (when the
    sequence gets that far) follows p_i. The bug of a wrong residual fails the same bound."""
    generator = torch.Generator().manual_seed(0)
    trials, drafts_per_trial, vocab = 100_000, 3, 12
    p = torch.softmax(torch.randn(drafts_per_trial + 1, vocab, generator=generator) * 1.5, -1).double()
    q = torch.softmax(torch.randn(drafts_per_trial, vocab, generator=generator) * 1.5, -1).double()
    drafts = torch.stack([torch.multinomial(q[i].float(), trials, True, generator=generator) for i in range(3)], 1)
    uniforms = torch.rand(trials, drafts_per_trial + 1, dtype=torch.float64, generator=generator)
    counts = torch.full((trials,), drafts_per_trial)

    def worst_ratio() -> float:
        num_accepted, last = verify_drafts(p.expand(trials, -1, -1), drafts, counts, q.expand(trials, -1, -1), uniforms)
        ratios = []
        for position in range(drafts_per_trial + 1):
            reached = num_accepted >= position  # trials whose output has a token at this position
            token = torch.where(num_accepted > position, drafts[:, min(position, drafts_per_trial - 1)], last)
            n = int(reached.sum())
            frequency = torch.bincount(token[reached], minlength=vocab).double() / n
            bound = frequency_bound(p[position], n, tests=drafts_per_trial + 1)
            ratios.append(float(((frequency - p[position]).abs() / bound).max()))
        return max(ratios)

    assert worst_ratio() <= 1.0
    correct = acceptance.residual_distribution
    acceptance.residual_distribution = lambda target, draft: target
    try:
        assert worst_ratio() > 1.0
    finally:
        acceptance.residual_distribution = correct


def test_greedy_targets_accept_exactly_their_argmax() -> None:
    p = torch.zeros(1, 4, 5)
    p[0, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0  # the argmax path 1, 2, 3, 4
    for drafts, accepted, last in (([1, 2, 0], 2, 3), ([1, 2, 3], 3, 4), ([0, 2, 3], 0, 1)):
        got = verify_drafts(p, torch.tensor([drafts]), torch.tensor([3]), None, torch.zeros(1, 4, dtype=torch.float64))
        assert (int(got[0]), int(got[1])) == (accepted, last)


def test_the_greedy_check_keeps_what_the_sampling_pipeline_keeps() -> None:
    """The plain-greedy shortcut (argmax compare) against the acceptance rule on the pipeline's point masses, on the
    same logits, with drafts that match their rows' argmax for a while and rows whose maximum is tied (the first
    maximum is the token `sample` picks: a last-maximum argmax would keep other drafts here)."""
    generator = torch.Generator().manual_seed(0)
    counts = [3, 1, 4, 2, 4]
    logits = torch.randn(sum(counts) + len(counts), 11, generator=generator)
    logits[:, 7] = logits[:, 2] = logits.max(dim=-1).values + 1.0  # every row's top is tied between tokens 2 and 7
    logits[[1, 6, 12], 9] = 9.0  # a few rows with a clear winner
    best = logits.max(dim=-1).indices.tolist()
    assert set(best) == {2, 9}
    drafts, first = [], 0
    for i, count in enumerate(counts):  # sequence i's drafts follow the argmax for its first i % (count + 1) rows
        drafts.append([best[first + j] if j < i % (count + 1) else 7 for j in range(count)])
        first += count + 1
    num_accepted, next_token = verify_greedy_drafts(logits, drafts)
    probs = torch.zeros_like(logits)
    probs[torch.arange(len(best)), torch.tensor(best)] = 1.0  # draw_probabilities' greedy rows
    target = torch.zeros(len(counts), max(counts) + 1, logits.shape[1])
    first = 0
    for b, count in enumerate(counts):
        target[b, : count + 1] = probs[first : first + count + 1]
        first += count + 1
    padded = torch.tensor([tokens + [0] * (max(counts) - len(tokens)) for tokens in drafts])
    uniforms = torch.zeros(len(counts), max(counts) + 1, dtype=torch.float64)
    want_accepted, want_next = verify_drafts(target, padded, torch.tensor(counts), None, uniforms)
    assert num_accepted == want_accepted.tolist() == [0, 1, 2, 0, 4]
    assert next_token == want_next.tolist()


def test_sampled_logprobs_are_the_targets() -> None:
    model = tiny_model(VARIED)
    llm = make_llm(model, speculative=ngram())
    params = SamplingParams(n=2, temperature=0.7, max_tokens=12, logprobs=True, seed=5, ignore_eos=True)
    for prompt, out in zip([*PROMPTS, REPEATING_PROMPT], llm.generate([*PROMPTS, REPEATING_PROMPT], params)):
        for sample in out.outputs:
            expected = dense_logprobs(model, prompt, sample.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    assert llm.stats()["spec_accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible_and_filters_hold() -> None:
    model = tiny_model(VARIED)
    params = SamplingParams(n=2, temperature=1.0, top_k=3, top_p=0.9, max_tokens=10, seed=7, logprobs=True)
    runs = []
    for _ in range(2):
        llm = make_llm(model, speculative=draft(), draft_model=keep_layers(model, [0]))
        runs.append(llm.generate([REPEATING_PROMPT, PROMPTS[2]], params))
    assert token_ids(runs[0]) == token_ids(runs[1])
    for prompt, out in zip([REPEATING_PROMPT, PROMPTS[2]], runs[0]):
        for sample in out.outputs:  # every token is among the target's top 3 at its position
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = model(ids)[0, len(prompt) - 1 : -1]  # (T, V)
            top3 = logits.topk(3, dim=-1).indices
            assert all(token in top3[i] for i, token in enumerate(sample.token_ids))


def test_streaming_with_speculation_gives_the_generated_text() -> None:
    llm = make_llm(tiny_model(LOOPING), speculative=ngram())
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    deltas = list(llm.stream(REPEATING_PROMPT, params))
    whole = llm.generate([REPEATING_PROMPT], params)[0].outputs[0]
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert any(len(d.token_ids) > 1 for d in deltas)  # several tokens in one step


# ---- the n-gram index ------------------------------------------------------------------------------------------


def test_ngram_lookup_prefers_the_longest_latest_match() -> None:
    index = NgramIndex(ngram_min=1, ngram_max=3)
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 5, 1, 2]
    index.update(tokens)
    # suffix (1, 2) last occurred at 4..5 (followed by 4), before that at 0..1; no (x, 1, 2) occurred before
    assert index.lookup(tokens, 3) == [4, 7, 2]
    tokens += [3]
    index.update(tokens)
    assert index.lookup(tokens, 2) == [9, 1]  # (1, 2, 3) beats the later (2, 3)
    assert index.lookup([8], 2) == []  # never seen: no proposal


def test_ngram_proposals_continue_a_repeating_pattern() -> None:
    index = NgramIndex(ngram_min=1, ngram_max=2)
    tokens = [4, 5, 4, 5]
    index.update(tokens)
    assert index.lookup(tokens, 5) == [4, 5, 4, 5, 4]  # the match at 0..1 runs into the end and keeps going
    index = NgramIndex(ngram_min=2, ngram_max=2)
    index.update([3, 3])
    assert index.lookup([3, 3], 2) == []  # the suffix itself is never its own match


# ---- config ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        ({"method": "medusa"}, "speculative.method='medusa': must be one of ngram, draft"),
        ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens=0: must be an integer in [1, 16]"),
        ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "speculative.ngram_min=3: must be <= "),
        ({"method": "ngram", "draft_model": "x"}, "is set but speculative.method='ngram'"),
        ({"method": "ngram", "k": 3}, "speculative: unknown key 'k'"),
        (7, "speculative=7: must be None, a method name"),
    ],
)
def test_bad_speculative_configs_fail_with_the_key(speculative, message: str) -> None:
    with pytest.raises(PosttrainError, match=None) as error:
        EngineConfig(speculative=speculative)
    assert message in str(error.value)


def test_draft_models_are_checked() -> None:
    model = tiny_model()
    with pytest.raises(PosttrainError, match="needs speculative.draft_model"):
        make_llm(model, speculative="draft")
    small_vocab = copy.deepcopy(model)
    small_vocab.config = copy.copy(model.config)
    small_vocab.config.vocab_size = 32
    with pytest.raises(PosttrainError, match="vocab_size 32 differs from the target's 64"):
        make_llm(model, speculative=draft(), draft_model=small_vocab)
    with pytest.raises(PosttrainError, match="draft_model= needs speculative decoding on"):
        make_llm(model, draft_model=model)
    with pytest.raises(PosttrainError, match="no such|not found|does not exist"):
        make_llm(model, speculative=draft(draft_model="/nonexistent/draft"))

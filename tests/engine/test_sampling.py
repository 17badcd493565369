"""The sampler: each filter against a hand-computed case and against transformers' logits
processors on identical tensors, then the batched `sample` (greedy, logprobs, seeds, mixed rows,
min_tokens, the drawn frequencies)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from posttrain.engine.sampler import (
    SUM_BLOCK,
    SampleOutput,
    SamplingRow,
    SamplingWorkspace,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample,
    sample_from_weights,
)
from posttrain.engine.sampling_params import InvalidSamplingParams, SamplingParams
from posttrain.errors import PosttrainError
from tests.numeric import serial_sum_rtol

NEG_INF = float("-inf")


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None) -> None:
    """Default: logprobs against log_softmax. An unfiltered draw takes the C sampler, which sums a block of weights
    serially in fp32 (worst case: every rounding one way, tests/numeric.py), then subtracts the log from the
    logit (a few roundings of its size)."""
    # (torch.testing.assert_close costs seconds of imports on its first call)
    assert actual.shape == expected.shape
    if atol is None:
        atol = serial_sum_rtol(SUM_BLOCK + 4) + serial_sum_rtol(4) * max(1.0, expected.abs().max().item())
    assert (actual - expected).abs().max().item() <= atol, (actual, expected)


def row(prompt=(1, 2, 3), output=(), generator=None, eos=(0,), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, set(eos))


# --- SamplingParams -------------------------------------------------------------------------


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.seed, p.logprobs) == (16, 0, False, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.skip_special_tokens
    assert not p.include_stop_str_in_output


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("logprobs, top", [(None, 0), (False, 0), (True, 0), (0, 0), (5, 5)])
def test_num_top_logprobs(logprobs, top):
    assert SamplingParams(logprobs=logprobs).num_top_logprobs == top


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("stop", [""]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("max_tokens", -1),
        ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("seed", 1.5),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", True),
        ("prompt_logprobs", 1.5),
        ("ignore_eos", 1),
        ("skip_special_tokens", None),
        ("include_stop_str_in_output", "yes"),
    ],
)
def test_validation_names_the_field_and_value(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert field in str(error.value) and repr(value) in str(error.value)
    assert isinstance(error.value, PosttrainError)  # the CLI prints it as one line


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InvalidSamplingParams, match=r"min_tokens.*max_tokens \(4\).*got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=5, max_tokens=None)  # no limit: fine


# --- filters: hand-computed cases -----------------------------------------------------------

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()


def kept(filtered: torch.Tensor) -> list[int]:
    return (filtered[0] > NEG_INF).nonzero().squeeze(1).tolist()


def test_top_k_by_hand():
    assert kept(apply_top_k(LOGITS, torch.tensor([2]))) == [0, 1]
    assert kept(apply_top_k(LOGITS, torch.tensor([0]))) == [0, 1, 2, 3]  # off
    assert kept(apply_top_k(LOGITS, torch.tensor([-1]))) == [0, 1, 2, 3]  # off
    ties = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert kept(apply_top_k(ties, torch.tensor([1]))) == [1, 2]  # ties with the k-th stay, as in HF


def test_top_p_by_hand():
    # mass above each token: 0, 0.5, 0.8, 0.95 -> kept while < p
    assert kept(apply_top_p(LOGITS, torch.tensor([0.4]))) == [0]
    assert kept(apply_top_p(LOGITS, torch.tensor([0.7]))) == [0, 1]
    assert kept(apply_top_p(LOGITS, torch.tensor([0.9]))) == [0, 1, 2]
    assert kept(apply_top_p(LOGITS, torch.tensor([1.0]))) == [0, 1, 2, 3]


def test_min_p_by_hand():
    # threshold = min_p * 0.5
    assert kept(apply_min_p(LOGITS, torch.tensor([0.2]))) == [0, 1, 2]
    assert kept(apply_min_p(LOGITS, torch.tensor([0.5]))) == [0, 1]
    assert kept(apply_min_p(LOGITS, torch.tensor([0.0]))) == [0, 1, 2, 3]


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0, 3.0]])
    # prompt has token 0; output has token 1 twice and token 3 once; token 4 unseen
    out = apply_penalties(logits, [[0]], [[1, 3, 1]], torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # prompt only: repetition
                -2.0 * 2 - 0.5 - 0.25 * 2,  # output twice: rep, presence, 2x frequency
                1.0,  # unseen
                0.0 - 0.5 - 0.25,  # output once, 0 stays 0 under repetition
                3.0,
            ]
        ]
    )
    assert_close(out, expected)
    assert logits[0, 0] == 2.0  # the input is left alone


def test_penalties_match_a_dense_reference_with_repeats_and_neutral_rows():
    generator = torch.Generator().manual_seed(5)
    vocab = 40
    logits = random_logits(4, vocab, seed=5)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (12, 0, 30, 5)]
    outputs = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (25, 7, 0, 9)]
    rep, presence, frequency = (
        torch.tensor(v) for v in ([1.3, 0.8, 1.0, 1.0], [0.5, -0.4, 1.0, 0.0], [0.3, 1.1, -0.7, 0.0])
    )
    ours = apply_penalties(logits, prompts, outputs, rep, presence, frequency)

    counts = torch.stack(
        [torch.bincount(torch.tensor(o, dtype=torch.long), minlength=vocab).float() for o in outputs]
    )  # (R, V)
    in_prompt = torch.stack(
        [torch.bincount(torch.tensor(p, dtype=torch.long), minlength=vocab) > 0 for p in prompts]
    )  # (R, V)
    seen = in_prompt | (counts > 0)
    expected = torch.where(seen, torch.where(logits < 0, logits * rep[:, None], logits / rep[:, None]), logits)
    expected = expected - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    assert_close(ours, expected, atol=1e-5)
    assert torch.equal(ours[3], logits[3])  # penalties 1, 0, 0: untouched


def test_penalties_ignore_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 1.0]])
    out = apply_penalties(logits, [[5, -1]], [[7]], torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert torch.equal(out, logits)


# --- filters: transformers' processors on identical tensors ---------------------------------


@pytest.mark.parametrize("k", [1, 7, 50, 999])
def test_top_k_matches_transformers(k):
    logits = random_logits(4, 1000)
    ours = apply_top_k(logits, torch.full((4,), k))
    assert torch.equal(ours, TopKLogitsWarper(k)(None, logits))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [1.0, 5.0])  # 1.0: flat, the nucleus outgrows the first candidates
def test_top_p_matches_transformers(p, scale):
    logits = random_logits(4, 6000, scale=scale)
    ours = apply_top_p(logits, torch.full((4,), p))
    assert torch.equal(ours, TopPLogitsWarper(p)(None, logits))


def test_top_p_per_row_values_match_transformers_row_by_row():
    logits = random_logits(3, 500, scale=2.0)
    top_p = torch.tensor([0.3, 1.0, 0.8])
    ours = apply_top_p(logits, top_p)
    for r, p in enumerate(top_p.tolist()):
        theirs = logits[r : r + 1] if p == 1.0 else TopPLogitsWarper(p)(None, logits[r : r + 1])
        assert torch.equal(ours[r : r + 1], theirs)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.6])
def test_min_p_matches_transformers(min_p):
    logits = random_logits(4, 1000)
    ours = apply_min_p(logits, torch.full((4,), min_p))
    assert torch.equal(ours > NEG_INF, MinPLogitsWarper(min_p)(None, logits) > NEG_INF)


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_matches_transformers(penalty):
    logits = random_logits(2, 300)
    prompts, outputs = [[1, 5, 5, 299], [7]], [[9, 1], [8, 8, 3]]
    ours = apply_penalties(logits, prompts, outputs, torch.full((2,), penalty), torch.zeros(2), torch.zeros(2))
    seen = torch.tensor([[1, 5, 5, 299, 9, 1], [7, 8, 8, 3, 3, 3]])  # HF: prompt + output ids
    assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(penalty)(seen, logits))


def test_logprobs_match_transformers_temperature_warper():
    logits = random_logits(3, 400)
    rows = [row(temperature=t) for t in (0.5, 1.0, 1.7)]
    output = sample(logits, rows)
    for r, t in enumerate((0.5, 1.0, 1.7)):
        expected = torch.log_softmax(TemperatureLogitsWarper(t)(None, logits[r : r + 1]), -1)
        assert_close(output.logprobs[r], expected[0, output.token_ids[r]])


# --- the batched sampler --------------------------------------------------------------------


def test_greedy_is_argmax_and_reports_temperature_one_logprobs():
    logits = random_logits(5, 700)
    output = sample(logits, [row(temperature=0.0, top_k=3, top_p=0.5) for _ in range(5)])
    assert torch.equal(output.token_ids, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, output.token_ids[:, None]).squeeze(1)
    assert_close(output.logprobs, expected)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=20),
        dict(temperature=0.9, top_p=0.8),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.6, top_k=50, top_p=0.9, min_p=0.01),
    ],
)
def test_logprobs_are_the_full_distribution_before_truncation(params):
    logits = random_logits(6, 2000, seed=1)
    output = sample(logits, [row(**params) for _ in range(6)])
    expected = torch.log_softmax(logits / params["temperature"], -1)
    expected = expected.gather(1, output.token_ids[:, None]).squeeze(1)
    assert output.logprobs.dtype == torch.float32 and output.token_ids.dtype == torch.int64
    assert_close(output.logprobs, expected)


def test_logprobs_include_penalties_and_min_tokens_mask():
    logits = random_logits(1, 300, seed=2)
    r = row(
        prompt=[4, 5],
        output=[6],
        eos=[7],
        temperature=0.8,
        repetition_penalty=1.5,
        frequency_penalty=0.4,
        min_tokens=3,
        stop_token_ids=[8],
    )
    output = sample(logits, [r])
    z = apply_penalties(logits, [[4, 5]], [[6]], torch.tensor([1.5]), torch.tensor([0.0]), torch.tensor([0.4]))
    z[0, [7, 8]] = NEG_INF
    expected = torch.log_softmax(z / 0.8, -1)[0, output.token_ids[0]]
    assert_close(output.logprobs[0], expected)


def test_top_logprobs():
    logits = random_logits(3, 500)
    rows = [row(logprobs=4), row(), row(temperature=0.0, logprobs=2)]
    output = sample(logits, rows)
    assert output.top_logprobs is not None and output.top_logprobs[1] == []
    for r, k in ((0, 4), (2, 2)):
        values, ids = torch.log_softmax(logits[r], -1).topk(k)
        assert [t for t, _ in output.top_logprobs[r]] == ids.tolist()
        assert [v for _, v in output.top_logprobs[r]] == pytest.approx(values.tolist(), abs=1e-6)
    assert sample(logits, [row(logprobs=True) for _ in range(3)]).top_logprobs is None


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 3] = logits[0, 4] = 50.0  # eos=3 and stop id 4 would win every draw
    blocked = row(output=[1], eos=[3], stop_token_ids=[4], min_tokens=2)
    for _ in range(20):
        assert sample(logits, [blocked]).token_ids[0].item() not in (3, 4)
    reached = row(output=[1, 1], eos=[3], stop_token_ids=[4], min_tokens=2)
    assert sample(logits, [reached]).token_ids[0].item() in (3, 4)
    # ignore_eos: eos does not stop the sequence, so it is an ordinary token; stop ids stay masked
    ignoring = row(output=[1], eos=[3], stop_token_ids=[4], min_tokens=2, ignore_eos=True)
    assert sample(logits, [ignoring]).token_ids[0].item() == 3


def test_greedy_min_tokens():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    assert sample(logits, [row(output=[], eos=[1], min_tokens=1, temperature=0.0)]).token_ids.item() == 2


def test_filters_never_draw_removed_tokens():
    logits = random_logits(256, 300, seed=3)
    cases = [dict(top_k=5), dict(top_p=0.3), dict(min_p=0.2)]
    for params in cases:
        output = sample(logits, [row(**params)] * 256)
        p = SamplingParams(**params)
        allowed = apply_min_p(
            apply_top_p(apply_top_k(logits, torch.full((256,), p.top_k)), torch.full((256,), p.top_p)),
            torch.full((256,), p.min_p),
        )
        assert (allowed.gather(1, output.token_ids[:, None]) > NEG_INF).all()


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = expected_probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "drew a token the filtered distribution excludes"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def test_drawn_frequencies_follow_the_filtered_distribution():
    torch.manual_seed(1234)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    params = dict(temperature=0.8, top_k=6, top_p=0.9)
    draws = 20_000
    output = sample(logits.expand(draws, -1), [row(**params)] * draws)  # rows are read-only
    counts = torch.bincount(output.token_ids, minlength=8).float()
    filtered = apply_top_p(apply_top_k(logits / 0.8, torch.tensor([6])), torch.tensor([0.9]))
    expected = torch.softmax(filtered, -1)[0]
    degrees = int((expected > 0).sum()) - 1
    # 99.99th percentile of chi-square is below df + 6 * sqrt(2 df) + 10 for these df
    assert chi_square(counts, expected) < degrees + 6 * math.sqrt(2 * degrees) + 10


@pytest.mark.parametrize("vocab", [7, 1024, 2500])  # one block, exactly one, a short tail block
def test_sample_from_weights_frequencies(vocab):
    generator = torch.Generator().manual_seed(7)
    weights = torch.zeros(vocab)
    support = torch.tensor(sorted({0, 3, vocab // 2, vocab - 2, vocab - 1}))
    weights[support] = torch.tensor([1.0, 4.0, 2.0, 0.5, 2.5])[: len(support)]
    draws = 4_000
    tokens = sample_from_weights(weights.expand(draws, -1), torch.rand(draws, generator=generator))
    counts = torch.bincount(tokens, minlength=vocab).float()
    degrees = len(support) - 1
    assert chi_square(counts, weights / weights.sum()) < degrees + 6 * math.sqrt(2 * degrees) + 10


def test_sample_from_weights_edges_of_the_unit_interval():
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]] * 3)
    uniforms = torch.tensor([0.0, 1.0 / 3, 1.0 - 2**-24])
    assert sample_from_weights(weights, uniforms).tolist() == [1, 3, 3]


def test_seeded_rows_do_not_depend_on_the_batch():
    # V above torch's 32768-element grain: a plain one-row sum would be split across threads
    vocab, steps = 40_000, 4
    seeded_params = dict(temperature=0.9, top_p=0.95, seed=42)

    def run(batch_size: int, neighbour_params: dict, seed_offset: int) -> list[tuple[int, float]]:
        generator = make_generator(42)
        drawn: list[tuple[int, float]] = []
        for step in range(steps):
            logits = random_logits(1, vocab, seed=100 + step)
            others = random_logits(batch_size - 1, vocab, seed=seed_offset + step)
            position = (batch_size - 1) // 2
            batch = torch.cat([others[:position], logits, others[position:]])
            rows = [row(**neighbour_params) for _ in range(batch_size)]
            rows[position] = row(output=[t for t, _ in drawn], generator=generator, **seeded_params)
            output = sample(batch, rows)
            drawn.append((output.token_ids[position].item(), output.logprobs[position].item()))
        return drawn

    alone = run(1, {}, 0)
    assert len({t for t, _ in alone}) > 1
    assert run(4, dict(temperature=0.5, top_k=3), 1000) == alone  # bitwise, logprobs too
    assert run(5, dict(temperature=1.0, repetition_penalty=1.2, logprobs=2, top_p=0.5), 2000) == alone
    torch.manual_seed(0)  # the default generator drives unseeded rows only
    assert run(3, {}, 3000) == alone


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = random_logits(1, 5000, scale=0.5)  # flat: draws rarely coincide by chance

    def draws(seed: int) -> list[int]:
        generator = make_generator(seed)
        return [sample(logits, [row(generator=generator, seed=seed)]).token_ids.item() for _ in range(8)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_mixed_rows_in_one_batch():
    logits = random_logits(6, 800, seed=9)
    generator = make_generator(1)
    rows = [
        row(temperature=0.0),
        row(temperature=0.5, top_k=1),  # top-1: deterministic
        row(temperature=1.0, repetition_penalty=1e4, output=[int(logits[2].argmax())], top_k=1),
        row(temperature=2.0, min_p=1.0),  # min_p 1: only the max survives
        row(generator=generator, seed=1, top_p=1e-6),  # nucleus of one token
        row(temperature=0.7, logprobs=1),
    ]
    output = sample(logits, rows)
    top2 = logits[2].topk(2).indices
    assert output.token_ids[:5].tolist() == [
        logits[0].argmax().item(),
        logits[1].argmax().item(),
        top2[1].item(),
        logits[3].argmax().item(),
        logits[4].argmax().item(),
    ]
    assert output.top_logprobs[5][0][0] == logits[5].argmax().item()
    assert [len(t) for t in output.top_logprobs] == [0, 0, 0, 0, 0, 1]


def test_workspace_is_reused_across_shapes_and_logits_are_left_alone():
    workspace = SamplingWorkspace()
    for rows_count, vocab in ((8, 300), (3, 300), (10, 500)):
        logits = random_logits(rows_count, vocab)
        before = logits.clone()
        rows = [row(temperature=0.7, repetition_penalty=1.1, output=[1, 2], min_tokens=5) for _ in range(rows_count)]
        output = sample(logits, rows, workspace)
        assert isinstance(output, SampleOutput) and output.token_ids.shape == (rows_count,)
        assert torch.equal(logits, before)


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 rows of logits but 1"):
        sample(torch.zeros(2, 5), [row()])

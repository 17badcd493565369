"""Chained decode steps (posttrain/engine/chained_steps.py, decode_step.c's decode_chained_steps): greedy or plainly
sampled, the very tokens, logprobs and texts of one step at a time, fewer engine steps, and only where they apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain import kernels
from posttrain.engine import SamplingParams
from posttrain.engine.chained_steps import halting_tokens, uniforms_ahead
from posttrain.engine.config import EngineConfigError
from posttrain.engine.sequence import Sequence
from posttrain.engine.small_rows_linear import MAX_ROWS
from posttrain.models.transformer import Transformer
from posttrain.quant.inference import quantize_for_inference
from tests.engine.test_native_decode import variant
from tests.engine.tiny import EOS, make_llm, tiny_model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native CPU kernels are not built here")

PROMPTS = ["123", "45678", "9:;<=>?@A"]


def outputs(llm, prompts=PROMPTS, **params):  # noqa: ANN001, ANN201
    """Every sample's tokens, logprobs, top logprobs, text and finish / stop reasons."""
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 20, "logprobs": 2, **params})
    return [
        (c.token_ids, c.logprobs, c.top_logprobs, c.text, c.finish_reason, c.stop_reason)
        for out in llm.generate(prompts, sp)
        for c in out.outputs
    ]


def one_at_a_time(model, **fields):  # noqa: ANN001, ANN201
    return make_llm(model, decode_steps=1, **fields)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("decode_steps", [2, 5, 8])
def test_chained_steps_are_bit_for_bit_one_step_at_a_time(kind: str, decode_steps: int) -> None:
    """Three sequences decoding together (prompts of different lengths: their blocks fill at different steps), 20
    tokens each: chains of k steps and a last shorter one; the same tokens and the very same logprobs."""
    model = variant(kind)
    chained = make_llm(model, decode_steps=decode_steps)
    got = outputs(chained, ignore_eos=True)
    plain = one_at_a_time(model)
    assert got == outputs(plain, ignore_eos=True)
    # 19 tokens after the prefill's first: ceil(19 / k) chains instead of 19 steps
    assert chained.stats()["steps"] == plain.stats()["steps"] - 19 + -(-19 // decode_steps)
    assert all(len(tokens) == 20 for tokens, *_ in got)


@pytest.mark.parametrize("compute", ["q8_0", "int8", "bfloat16"])
def test_chained_steps_through_each_kind_of_layer(compute: str) -> None:
    """The LM head and the layers in q8_0 or int8 codes, or the engine's bf16 copies: each step's head is the
    module path's kernel on the same input."""
    torch.manual_seed(0)  # every layer's input a multiple of q8_0's groups of 32
    model = Transformer(dataclasses.replace(tiny_model().config, hidden_size=64, num_attention_heads=8)).eval()
    fields = {}
    if compute == "bfloat16":
        fields["compute_dtype"] = "bfloat16"
    else:
        quantize_for_inference(model, compute)
    chained = make_llm(model, **fields)
    got = outputs(chained, ignore_eos=True)
    assert chained.stats()["steps"] < 10  # chains ran (one step at a time takes 19 after the prefill)
    assert got == outputs(one_at_a_time(model, **fields), ignore_eos=True)


def test_a_stop_token_inside_a_chain_ends_its_sequence_there() -> None:
    """A token in one sequence's stop_token_ids halts the chain after the step that drew it: that sequence ends
    with it, the others keep the tokens drawn with it and go on; the blocks all come back."""
    model = tiny_model()
    free = make_llm(model).generate(["45678"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = free[0].outputs[0].token_ids[6]  # a token greedy decoding draws 7th: inside the first chain of 8
    chained, plain = make_llm(model), one_at_a_time(model)
    got = outputs(chained, ["45678", "123"], ignore_eos=True, stop_token_ids=[stop])
    assert got == outputs(plain, ["45678", "123"], ignore_eos=True, stop_token_ids=[stop])
    assert got[0][4:] == ("stop", stop) and len(got[0][0]) <= 7
    manager = chained.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_eos_stop_strings_and_max_tokens_apply_token_by_token() -> None:
    model = tiny_model()
    chained, plain = make_llm(model), one_at_a_time(model)
    for params in (
        {"max_tokens": 13},  # not a multiple of the chain: the last chain is shorter
        {"max_tokens": 1},  # the prefill's token only
        {"max_tokens": 30},  # EOS where the model draws it
        {"stop": ["5", "AB"], "max_tokens": 30},  # texts cut inside a chain; the tokens after the stop dropped
        {"stop": ["5"], "include_stop_str_in_output": True},
        {"min_tokens": 6, "max_tokens": 20},  # the EOS mask holds the first 6 tokens one step at a time
    ):
        assert outputs(chained, **params) == outputs(plain, **params), params
    manager = chained.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_chains_draw_what_one_step_at_a_time_draws(temperature: float, seeded: bool) -> None:
    """Plain temperature sampling, n = 2 per prompt (six sequences), one of the first sample's tokens a stop token (so
    it ends inside the first chain): the same tokens and logprobs, seeded (each sample's own generator) or from torch's
    default generator, whose later draws are also the same (a chain that stopped early gave back the uniforms it did
    not use)."""
    model = variant("qwen3")
    params = {"temperature": temperature, "n": 2, "max_tokens": 30, "logprobs": True, "ignore_eos": True}
    if seeded:
        params["seed"] = 5
    torch.manual_seed(11)
    stop = outputs(make_llm(model), **params)[0][0][4]
    got, want = [], []
    for llm, out in ((make_llm(model), got), (one_at_a_time(model), want)):
        torch.manual_seed(11)
        out.extend(outputs(llm, **params, stop_token_ids=[stop]))
        out.append(torch.rand(3).tolist())  # the default generator where the run left it
        out.append(llm.stats()["steps"])
    assert got[:-1] == want[:-1]
    assert got[0][4:] == ("stop", stop) and len(got[0][0]) <= 5
    assert got[-1] < want[-1] / 3  # chains ran


def test_a_batch_with_mixed_or_filtered_or_penalised_draws_goes_one_step_at_a_time() -> None:
    model = tiny_model()
    chained = make_llm(model)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for other in (
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),  # greedy and sampled together
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
    ):
        before = chained.stats()["steps"]
        got = chained.generate(["123", "456"], [greedy, other])
        assert chained.stats()["steps"] - before == 12  # the prefill's step and 11 single decode steps
        want = one_at_a_time(model).generate(["123", "456"], [greedy, other])
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_no_chain_while_a_request_waits_to_be_admitted() -> None:
    """With room for one sequence, the second prompt waits: the first goes one step at a time until it ends, then
    the second chains."""
    model = tiny_model()
    chained = make_llm(model, max_num_seqs=1)
    got = outputs(chained, ["123", "456"], ignore_eos=True, max_tokens=10)
    assert got == outputs(one_at_a_time(model, max_num_seqs=1), ["123", "456"], ignore_eos=True, max_tokens=10)
    # the first: prefill + 9 steps while the second waits; the second: prefill + one chain of 8 + one of 1
    assert chained.stats()["steps"] == 10 + 1 + 2


def test_streaming_gets_a_chain_at_a_time_and_the_same_text() -> None:
    model = tiny_model()
    llm = make_llm(model)
    engine = llm.engine
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True), stream=True)
    seen: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(len(out.outputs[0].token_ids))
    assert seen == [1, 9, 17]  # the prefill's token, then chains of 8
    final = outputs(one_at_a_time(model), ["123"], max_tokens=17, ignore_eos=True)
    assert out.outputs[0].token_ids == final[0][0]


def test_prefix_cache_blocks_filled_by_a_chain_serve_the_next_request() -> None:
    """The K/V a chain computed is published like a plain step's: a later prompt that continues the first
    request's text reuses those blocks and decodes the same tokens as a fresh engine."""
    model = tiny_model()
    llm = make_llm(model)
    first = llm.generate(["123"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    follow = [1, 2, 3, *first.outputs[0].token_ids[:12]]
    again = llm.generate([follow], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert again.num_cached_tokens >= 12
    fresh = one_at_a_time(model, enable_prefix_caching=False)
    assert (
        again.outputs[0].token_ids
        == fresh.generate([follow], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )


def test_head_and_embedding_changes_are_seen_and_a_hooked_head_runs_its_hook() -> None:
    model = tiny_model()
    llm = make_llm(model, enable_prefix_caching=False)
    before = outputs(llm, ignore_eos=True)
    with torch.no_grad():
        model.lm_head.weight[:, :8].mul_(-2.0)  # in place, as an optimizer step (tied: the embedding too)
    changed = outputs(llm, ignore_eos=True)
    assert changed != before and changed == outputs(one_at_a_time(model), ignore_eos=True)
    calls: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(1))
    steps = llm.stats()["steps"]
    hooked = outputs(llm, ignore_eos=True)
    assert hooked == changed and llm.stats()["steps"] - steps == 20  # one step per token: the hook runs each
    assert len(calls) == 20
    handle.remove()
    outputs(llm, ignore_eos=True)
    assert llm.stats()["steps"] - steps - 20 < 10  # chained again


def test_speculative_decoding_with_chains_is_still_plain_greedy() -> None:
    """Steps where the n-gram proposer drafts check the drafts; the others chain. The output is the plain one."""
    model = tiny_model(0)  # falls into a loop: the n-gram drafts are accepted often
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = make_llm(model, speculative={"method": "ngram", "num_tokens": 4})
    got = spec.generate([prompt], sp)[0].outputs[0].token_ids
    assert got == one_at_a_time(model).generate([prompt], sp)[0].outputs[0].token_ids
    assert spec.stats()["spec_draft_tokens"] > 0


def test_a_chains_time_counts_per_decode_step_in_the_draft_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive draft length weighs a draft row against a plain decode step: a chain of n steps that took t
    seconds is timed as n steps of t / n each (every engine step takes one tick of this clock)."""
    from posttrain.engine import llm_engine

    class Ticks:
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            cls.now += 1.0  # read at the start and the end of each step: every step takes 1.0
            return cls.now

    monkeypatch.setattr(llm_engine, "time", Ticks)
    spec = make_llm(tiny_model(1), speculative={"method": "ngram", "num_tokens": 4})
    timed, chained = [], []
    length, decoder = spec.engine.speculator.length, spec.engine.speculator
    monkeypatch.setattr(length, "step_took", lambda seqs, rows, seconds: timed.append((seqs, rows, seconds)))
    real_chained = decoder.chained
    monkeypatch.setattr(decoder, "chained", lambda steps: (chained.append(steps), real_chained(steps)))
    spec.generate([[3, 1, 4]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    plain = [seconds for seqs, rows, seconds in timed if rows == 0]
    assert max(chained) > 1  # some steps chained
    assert sorted(plain) == sorted([1.0 / n for n in chained] + [1.0] * (len(plain) - len(chained)))


def one_step_uniforms(steps: int, then: int) -> tuple[list, list]:
    """sampler.py's `_uniforms` for [unseeded, seeded (seed 3), unseeded] over `steps` steps from torch seed 0, and
    then `then` more draws of the default generator and of the seeded one."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    drawn = []
    for _ in range(steps):
        pair = torch.rand(2, dtype=torch.float64).tolist()  # the unseeded rows' draw, in batch order
        drawn.append([pair[0], torch.rand(1, dtype=torch.float64, generator=generator).item(), pair[1]])
    after = [
        torch.rand(then, dtype=torch.float64).tolist(),
        torch.rand(then, dtype=torch.float64, generator=generator).tolist(),
    ]
    return drawn, after


def test_uniforms_drawn_ahead_are_the_one_step_draws_and_rewind_to_what_was_used() -> None:
    def batch() -> list[Sequence]:
        seeded = Sequence("r", [1, 2], SamplingParams(seed=3), torch.Generator().manual_seed(3))
        return [Sequence("r", [1, 2], SamplingParams(), None), seeded, Sequence("r", [1, 2], SamplingParams(), None)]

    for ran in (5, 2, 0):  # the chain ran all its 5 steps, 2 of them, none (the native step could not take it)
        seqs = batch()
        torch.manual_seed(0)
        uniforms, rewind = uniforms_ahead(seqs, 5)
        rewind(ran)
        after = [
            torch.rand(3, dtype=torch.float64).tolist(),
            torch.rand(3, dtype=torch.float64, generator=seqs[1].generator).tolist(),
        ]
        drawn, expected_after = one_step_uniforms(ran, 3)
        assert uniforms[:ran].tolist() == drawn
        assert after == expected_after
    assert uniforms.tolist() == one_step_uniforms(5, 0)[0]


def test_halting_tokens_are_the_ones_that_can_end_a_sequence_of_the_batch() -> None:
    def seq(**params) -> Sequence:  # noqa: ANN003
        return Sequence("r", [1, 2], SamplingParams(**params), None)

    assert halting_tokens([seq(ignore_eos=True)], {EOS}) == []
    assert halting_tokens([seq(ignore_eos=True, stop_token_ids=[4, 2])], {EOS}) == [2, 4]
    assert halting_tokens([seq(ignore_eos=True), seq(stop_token_ids=[5])], {EOS, 60}) == [5, 60, EOS]


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "8"])
def test_bad_decode_steps_is_one_clear_error(value: object) -> None:
    with pytest.raises(EngineConfigError, match=f"decode_steps={value!r}: must be a positive integer"):
        make_llm(decode_steps=value)


def test_steps_of_more_than_max_rows_sequences_go_one_at_a_time() -> None:
    """A wide step (a rollout's) is mostly the model's work: it is not chained, even in bf16 where the native step
    takes it."""
    model = tiny_model()
    llm = make_llm(model, compute_dtype="bfloat16")
    sp = SamplingParams(temperature=0, n=MAX_ROWS + 1, max_tokens=6, ignore_eos=True)
    llm.generate(["123"], sp)
    assert llm.stats()["steps"] == 6  # the prefill's step and 5 single decode steps of 9 rows
    llm.generate(["123"], SamplingParams(temperature=0, n=MAX_ROWS, max_tokens=6, ignore_eos=True))
    assert llm.stats()["steps"] == 6 + 2  # the prefill's step and one chain of 5 steps of 8 rows


def test_an_update_between_chains_is_the_version_of_the_next_chain_tokens() -> None:
    """Async RL's weight updates land between engine steps: a chain's tokens all carry the version it ran under."""
    model = tiny_model()
    llm = make_llm(model, decode_steps=4)
    engine = llm.engine
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True))
    engine.step(), engine.step()  # the prefill's token, then a chain of 4
    with torch.no_grad():
        model.lm_head.weight.mul_(0.9)
    engine.weights_updated(keep_running_kv=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_policy_versions == [0] * 5 + [1] * 4

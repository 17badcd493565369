"""The shared-prefix training forward: same logprobs as the plain per-sample forward and as the engine."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import LLM, SamplingParams
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer
from posttrain.trainers.packed_groups import pack_groups, packed_forward, per_sample_logprobs
from tests.numeric import assert_reordered
from tests.trainers.rl_helpers import tiny_model, tokenizer


def _small_vocab_model() -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=97,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def _groups(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 1, 12)]
    lengths = [(1, 5, 3), (4, 2, 6), (9, 1, 1)]  # a 1-token completion is only ever a label
    completions = [[torch.randint(0, 97, (n,), generator=g).tolist() for n in group] for group in lengths]
    return prompts, completions


def test_pack_layout() -> None:
    prompts, completions = _groups()
    packed = pack_groups(prompts, completions)
    # one row per group: the prompt once, then each completion without its last token
    assert packed.input_ids.shape[0] == 3
    assert packed.num_input_tokens == sum(len(p) + sum(len(c) - 1 for c in grp) for p, grp in zip(prompts, completions))
    assert packed.labels.numel() == sum(len(c) for grp in completions for c in grp)
    row = packed.mask[0, 0]
    P = len(prompts[0])
    first = P  # completion 0 has no inputs (length 1); completion 1 starts at P
    assert row[first, :P].all() and row[first, first] and not row[first, first + 1 :].any()
    second = P + 4  # completion 2 starts after completion 1's 4 input tokens
    assert not row[second, P : P + 4].any(), "a completion must not see its siblings"
    assert packed.positions[0, second].item() == P, "each completion's positions continue from the prompt"


def test_wide_groups_are_cut_into_rows_of_consecutive_completions() -> None:
    prompts, completions = _groups()
    # inputs after the prompt, row_tokens 10: group 0: 7 + [0, 4] (11: 2 would not fit), then 7 + [2]; group 1:
    # 1 + [3, 1, 5] (10 fits); group 2: 12 + [8, 0, 0] (wider than 10, and no row would be narrower)
    packed = pack_groups(prompts, completions, row_tokens=10)
    assert packed.row_group.tolist() == [0, 0, 1, 2]
    assert packed.sample_row.tolist() == [0, 0, 1, 2, 2, 2, 3, 3, 3]  # samples stay numbered group by group
    assert packed.mask[0, 0, :, 0].sum() == 11 and packed.mask[1, 0, :, 0].sum() == 9
    assert packed.input_ids[1, :7].tolist() == prompts[0] and packed.positions[1, 7].item() == 7  # the prompt again
    assert packed.input_ids.shape == (4, 20)  # padded to the widest row, group 2's
    one_row = pack_groups(prompts, completions)
    assert torch.equal(packed.labels, one_row.labels) and torch.equal(packed.token_index, one_row.token_index)


@pytest.mark.parametrize("temperature, row_tokens", [(1.0, None), (0.7, None), (1.0, 10)])
def test_packed_forward_matches_per_sample_forward(temperature: float, row_tokens: int | None) -> None:
    model = _small_vocab_model()
    prompts, completions = _groups()
    with torch.no_grad():
        pack = pack_groups(prompts, completions, row_tokens=row_tokens)
        out = packed_forward(model, pack, temperature, with_entropy=True)
    flat_prompts = [p for p, grp in zip(prompts, completions) for _ in grp]
    flat_completions = [c for grp in completions for c in grp]
    with torch.no_grad():
        reference = per_sample_logprobs(model, flat_prompts, flat_completions, temperature)
    for b, ref in enumerate(reference):  # the same logprobs up to the sums' order (tests/numeric.py)
        assert_reordered(out.logprobs[b, : len(ref)], ref)
        assert out.logprobs[b, len(ref) :].abs().sum() == 0
    assert torch.isfinite(out.entropy).all()


def test_packed_gradients_match_per_sample_gradients() -> None:
    model = _small_vocab_model()
    prompts, completions = _groups(seed=3)
    weights = torch.linspace(-1, 1, 9)  # a different weight per sample, so sample mix-ups show
    packed = pack_groups(prompts, completions)
    (packed_forward(model, packed, 1.0).logprobs.sum(1) * weights).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    flat_prompts = [p for p, grp in zip(prompts, completions) for _ in grp]
    per_sample = per_sample_logprobs(model, flat_prompts, [c for grp in completions for c in grp], 1.0)
    sum(w * lp.sum() for w, lp in zip(weights, per_sample)).backward()
    for got, p in zip(packed_grads, model.parameters()):
        assert_reordered(got, p.grad)


def test_recomputed_logprobs_equal_engine_rollout_logprobs() -> None:
    tok = tokenizer()
    model = tiny_model(tok)
    llm = LLM(model=model, tokenizer=tok, max_num_seqs=16, max_model_len=128)
    prompts = [[{"role": "user", "content": "What is 12 plus 30?"}], [{"role": "user", "content": "Hi"}]]
    outs = llm.generate(prompts, SamplingParams(n=4, temperature=0.8, max_tokens=8, logprobs=True))
    packed = pack_groups([o.prompt_token_ids for o in outs], [[s.token_ids for s in o.outputs] for o in outs])
    with torch.no_grad():
        ours = packed_forward(model, packed, 0.8).logprobs
    for b, sample in enumerate(s for o in outs for s in o.outputs):
        engine = torch.tensor(sample.logprobs)  # paged attention and the C kernels: every sum in another order
        assert_reordered(ours[b, : len(engine)], engine)


def test_selecting_groups_of_a_pack_is_packing_them_alone() -> None:
    """`PackedGroups.select` (the update's micro-batches without their zero-advantage groups) gives exactly
    the tensors `pack_groups` builds from those groups: nothing is packed twice."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 2, 7, 3)]
    completions = [
        [torch.randint(3, 200, (n,), generator=gen).tolist() for n in lengths]
        for lengths in ((3, 1, 4), (6, 2, 2), (1, 1, 5), (2, 7, 3))
    ]
    # Episodes score the model's tokens only; group 1's second sample has none (it stays a sample).
    scored = [
        [[(g + j + k) % 2 for k in range(len(c))] for j, c in enumerate(group)] for g, group in enumerate(completions)
    ]
    scored[1][1] = [0, 0]
    for flags, row_tokens in ((None, None), (scored, None), (scored, 8)):  # 8: groups 0, 1, 3 cut in two rows
        pack = pack_groups(prompts, completions, scored=flags, row_tokens=row_tokens)
        for groups in ([0], [1, 3], [0, 2, 3], [2], [0, 1, 2, 3]):
            selected = pack.select(groups)
            alone = pack_groups(
                [prompts[g] for g in groups],
                [completions[g] for g in groups],
                scored=None if flags is None else [flags[g] for g in groups],
                row_tokens=row_tokens,
            )
            for name in (
                "input_ids",
                "positions",
                "mask",
                "gather_index",
                "labels",
                "sample_index",
                "token_index",
                "sample_row",
                "row_group",
                "completion_mask",
            ):
                a, b = getattr(selected, name), getattr(alone, name)
                assert a.dtype == b.dtype and torch.equal(a, b), (groups, name, flags is None, row_tokens)
        assert selected.num_input_tokens == alone.num_input_tokens

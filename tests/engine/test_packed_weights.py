"""MKL-packed weights (posttrain/engine/packed_weights.py): the same numbers as F.linear, packed only when a
weight meets the same row count twice, rebuilt when the weight changes, and dropped when the engine idles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.engine import SamplingParams, packed_weights
from posttrain.engine.config import EngineConfigError
from posttrain.engine.packed_weights import MIN_ROWS, PackedWeights
from tests.engine.tiny import make_llm, tiny_model

pytestmark = pytest.mark.skipif(not packed_weights.available(), reason="this PyTorch has no MKL")


def _twice(packs: PackedWeights, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The first call records the row count; the second packs and computes."""
    assert packs.linear(x, weight, bias) is None
    return packs.linear(x, weight, bias)


@pytest.mark.parametrize("lead, bias", [((64,), False), ((512,), True), ((4, 25), False), ((100,), True)])
def test_packed_linear_equals_f_linear_bit_for_bit(lead: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(96, 40), torch.randn(*lead, 40)
    b = torch.randn(96) if bias else None
    packs = PackedWeights()
    out = _twice(packs, x, weight, b)
    assert out.shape == (*lead, 96)
    assert torch.equal(out, F.linear(x, weight, b))
    assert torch.equal(packs.linear(x, weight, b), F.linear(x, weight, b))  # the third call reuses the pack
    assert packs.num_packs == 1 and packs.num_packed == 1


@pytest.mark.parametrize("rows", [64, 100, 512])
def test_a_long_inner_dimension_agrees_to_float_rounding(rows: int) -> None:
    """SmolLM2's down projection (576 x 1536): MKL may split the 1536-long sums differently once packed."""
    torch.manual_seed(rows)
    weight, x = torch.randn(576, 1536), torch.randn(rows, 1536)
    out = _twice(PackedWeights(), x, weight)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=2e-6, atol=2e-5)


def test_a_new_row_count_is_packed_on_its_second_call_only() -> None:
    weight = torch.randn(32, 16)
    packs = PackedWeights()
    _twice(packs, torch.randn(80, 16), weight)
    assert packs.linear(torch.randn(90, 16), weight, None) is None  # a one-off M (a prefill chunk) packs nothing
    assert packs.num_packs == 1
    out = packs.linear(torch.randn(90, 16), weight, None)
    assert out is not None and packs.num_packs == 2


def test_a_changed_weight_is_packed_again() -> None:
    torch.manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(48, 24))
    x = torch.randn(MIN_ROWS, 24)
    packs = PackedWeights()
    with torch.no_grad():
        _twice(packs, x, weight)
        weight.add_(0.5)  # an optimizer step: in place, the version counter moves
        assert torch.equal(packs.linear(x, weight, None), F.linear(x, weight))
        assert packs.num_packs == 2
        weight.data = torch.randn(48, 24)  # new storage under the same Parameter
        assert torch.equal(packs.linear(x, weight, None), F.linear(x, weight))
        assert packs.num_packs == 3
    other = torch.randn(48, 24)  # another tensor is another entry, never the first one's pack
    assert packs.linear(x, other, None) is None


@pytest.mark.parametrize("case", ["few rows", "fp64", "needs grad", "1-d input", "transposed weight"])
def test_calls_that_do_not_qualify_take_f_linear(case: str) -> None:
    x, weight = torch.randn(MIN_ROWS, 8), torch.randn(16, 8)
    if case == "few rows":
        x = x[: MIN_ROWS - 1]
    elif case == "fp64":
        x, weight = x.double(), weight.double()
    elif case == "needs grad":
        weight.requires_grad_(True)
    elif case == "1-d input":
        x = x[0]
    else:
        weight = torch.randn(8, 16).t()
    packs = PackedWeights()
    for _ in range(3):
        assert packs.linear(x, weight, None) is None
    assert packs.num_packs == 0


def test_the_scope_routes_nn_linear_and_leaves_other_ops_alone() -> None:
    torch.manual_seed(2)
    layer, x = torch.nn.Linear(24, 40), torch.randn(MIN_ROWS, 24)
    packs = PackedWeights()
    with torch.inference_mode():
        expected = torch.relu(layer(x))
        with packs.scope():
            for _ in range(3):
                assert torch.equal(torch.relu(layer(x)), expected)
    assert packs.num_packs == 1
    with torch.inference_mode():
        layer(x)  # outside the scope: no new call reaches the packs
    assert packs.num_packs == 1
    with torch.inference_mode(), packs.scope():  # arguments by keyword reach the packs too
        assert torch.equal(F.linear(input=x, weight=layer.weight, bias=layer.bias), layer(x))


def _rollout(llm, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    outs = llm.generate(
        prompts, SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True, logprobs=True)
    )
    return [c.token_ids for o in outs for c in o.outputs], torch.tensor([c.logprobs for o in outs for c in o.outputs])


def _assert_same_rollout(a: tuple[list[list[int]], torch.Tensor], b: tuple[list[list[int]], torch.Tensor]) -> None:
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)


def test_the_engine_packs_while_generating_and_matches_an_unpacked_engine() -> None:
    """8 prompts x n=8: 64 decode rows a step, so every weight (the LM head too) gets packed. Tokens and
    logprobs equal an engine without packing, also after an in-place update of the weights."""
    prompts = [[1 + i, 2 + i, 3, 4 + i, 5] for i in range(8)]
    fields = dict(max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512)
    packed_model, plain_model = tiny_model(), tiny_model()
    packed = make_llm(packed_model, **fields)
    plain = make_llm(plain_model, pack_cpu_weights=False, **fields)
    packs = packed.engine.runner.packed_weights
    assert packs is not None and plain.engine.runner.packed_weights is None
    _assert_same_rollout(_rollout(packed, prompts), _rollout(plain, prompts))
    linears = sum(isinstance(m, torch.nn.Linear) for m in packed_model.modules())
    assert packs.num_packs == linears  # each weight once: decode keeps M = 64
    assert packs.num_packed == 0  # the engine went idle: the copies are gone
    for model, llm in ((packed_model, packed), (plain_model, plain)):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1)
        llm.weights_updated()
    _assert_same_rollout(_rollout(packed, prompts), _rollout(plain, prompts))


def test_no_packing_without_the_memory_for_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("posttrain.engine.runner.free_device_memory", lambda device: 1000)
    assert make_llm(tiny_model()).engine.runner.packed_weights is None


def test_pack_cpu_weights_must_be_a_bool() -> None:
    with pytest.raises(EngineConfigError, match="pack_cpu_weights='yes'"):
        make_llm(tiny_model(), pack_cpu_weights="yes")

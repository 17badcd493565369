"""The native matrix-vector kernel for a few input rows (posttrain/kernels/f32_linear.c) and its route in the
engine's fp32 CPU forward (posttrain/engine/small_rows_linear.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain import kernels
from posttrain.engine import SamplingParams
from posttrain.engine.small_rows_linear import MAX_ROWS, small_rows_linear
from tests.engine.tiny import make_llm
from tests.numeric import reorder_rtol

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native CPU kernels are not built here")


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS])
@pytest.mark.parametrize("shape", [(64, 576), (30, 100)])  # 30 rows: a last block of 2; K = 100: a tail of 4
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_f_linear(rows: int, shape: tuple[int, int], bias: bool) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(*shape), torch.randn(rows, shape[1])
    b = torch.randn(shape[0]) if bias else None
    got, want = kernels.f32_linear(x, weight, b), torch.nn.functional.linear(x, weight, b)
    # One sum of K products in another order than sgemm's, relative to the size of the terms.
    bound = reorder_rtol(2, shape[1]) * ((x.abs() @ weight.abs().t()).max() + (b.abs().max() if bias else 0))
    assert (got - want).abs().max() <= bound


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """Bit for bit: a decode row gets the same logits alone or beside other sequences (MKL's sgemm does not
    promise that across row counts)."""
    torch.manual_seed(0)
    weight, x = torch.randn(48, 200), torch.randn(MAX_ROWS, 200)
    together = kernels.f32_linear(x, weight)
    for i in range(MAX_ROWS):
        assert torch.equal(kernels.f32_linear(x[i : i + 1], weight)[0], together[i])


@pytest.mark.parametrize("case", ["too_many_rows", "bf16", "grad", "no_rows"])
def test_calls_that_do_not_qualify_are_left_to_f_linear(case: str) -> None:
    weight, x = torch.randn(16, 32), torch.randn(2, 32)
    if case == "too_many_rows":
        x = torch.randn(MAX_ROWS + 1, 32)
    elif case == "bf16":
        x, weight = x.bfloat16(), weight.bfloat16()
    elif case == "grad":
        weight.requires_grad_(True)
    elif case == "no_rows":
        x = torch.randn(0, 32)
    assert small_rows_linear(x, weight, None) is None


def test_leading_dimensions_are_kept() -> None:
    weight, x = torch.randn(16, 32), torch.randn(1, 3, 32)  # (B, T, K): 3 rows
    out = small_rows_linear(x, weight, None)
    assert out is not None and out.shape == (1, 3, 16)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))


def test_the_engine_decodes_through_it_when_the_kernels_are_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = kernels.f32_linear

    def counted(x, weight, bias=None):
        calls.append(x.shape[0])
        return kernel(x, weight, bias)

    monkeypatch.setattr(kernels, "f32_linear", counted)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    native = make_llm().generate(["123"], params)[0].outputs[0].token_ids
    assert calls and max(calls) <= MAX_ROWS  # the decode steps (1 row each) and the 3-token prefill
    calls.clear()
    plain = make_llm(cpu_kernels=False).generate(["123"], params)[0].outputs[0].token_ids
    assert not calls
    assert native == plain  # the same tokens (the tiny model's logits differ only by rounding)

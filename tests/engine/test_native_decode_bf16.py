"""The native decode step in the engine's bf16 compute (bf16_linear.c, the bf16 K/V pool in decode_step.c).

bf16_linear.c is oneDNN's bf16 GEMM (what the module path runs without the native kernels) up to the order of each
fp32 sum: an output either equals the GEMM's or is the bf16 number next to it, where the two sums fall on either
side of a rounding boundary. Through a model those flips compound like any bf16 reordering, so the engine-level
checks against the fp32 engine bound the logprobs, not bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain import kernels
from posttrain.engine import SamplingParams
from posttrain.engine.small_rows_linear import MAX_ROWS
from posttrain.models.transformer import Transformer
from posttrain.quant.inference import quantize_for_inference
from tests.engine.test_native_decode import generate, variant
from tests.engine.tiny import make_llm, tiny_model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native CPU kernels are not built here")


def bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 numbers lie between a and b, both bf16 values held in fp32 (the bit patterns' distance)."""
    as_int = lambda t: t.bfloat16().view(torch.int16).int()  # noqa: E731
    ia, ib = as_int(a), as_int(b)
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude -> a monotone integer line
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


@pytest.mark.parametrize("rows", [1, 5, 16, 200])  # a partial tile, whole tiles, two row chunks (192 + 8)
@pytest.mark.parametrize("shape", [(576, 576), (96, 1536), (7, 40), (9, 33), (130, 31)])  # block / pair tails too
def test_bf16_kernel_is_the_bf16_gemm_to_one_rounding_step(kernel_march, rows, shape):
    torch.manual_seed(rows)
    N, K = shape
    x, weight, bias = torch.randn(rows, K), torch.randn(N, K), torch.randn(N)
    want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float()  # (rows, N) the module path's product
    packed = kernels.bf16_pack(weight)
    got = kernels.bf16_linear(x, packed, N)
    assert torch.equal(got, got.bfloat16().float())  # each output rounded to bf16, as the GEMM's
    apart = bf16_steps_apart(got, want)
    assert apart.max() <= 1
    # A flip needs the two fp32 sums on either side of a rounding boundary: ~K ulp(fp32) of reorder against a bf16
    # step 2^16 fp32 ulps wide. Rounding the inputs any other way than to nearest even flips most outputs.
    assert apart.float().mean() <= 0.01
    assert torch.equal(kernels.bf16_linear(x, packed, N, bias), got + bias)  # the bias added after, in fp32
    # A row's sum does not depend on the rows beside it (the order runs over K alone).
    assert torch.equal(kernels.bf16_linear(x[-1:], packed, N), got[-1:])


def test_bf16_pack_is_the_weight_rounded_in_blocks_of_64_outputs_and_pairs_of_inputs():
    weight = torch.randn(70, 5)
    packed = kernels.bf16_pack(weight)
    assert packed.shape == (2, 3, 64, 2) and packed.dtype == torch.bfloat16
    padded = torch.zeros(128, 6, dtype=torch.bfloat16)
    padded[:70, :5] = weight.bfloat16()  # torch's cast: to nearest even
    assert torch.equal(packed, padded.view(2, 64, 3, 2).transpose(1, 2))
    with pytest.raises(ValueError, match="70 x 5"):
        kernels.bf16_linear(torch.randn(2, 5), packed[:1], 70)


@pytest.mark.parametrize(("temperature", "n"), [(0.0, 2), (1.0, 2), (1.0, 8)])
def test_bf16_decode_is_bit_for_bit_the_module_path(temperature: float, n: int):
    """Decode steps of 6 sequences, and of 24 (past the fp32 step's MAX_ROWS): the native step's linear layers are
    the module path's kernel over the same packed copies, its K/V rounded as the module path's cast and its
    attention the module path's plan, so the tokens and logprobs are the very same."""
    model = variant("qwen3")
    native = make_llm(model, compute_dtype="bfloat16")
    got = generate(native, n=n, temperature=temperature)
    assert native.engine.runner.native_decode.steps >= 10  # every decode step: 11 of them, 6 or 24 rows each
    plain = make_llm(model, compute_dtype="bfloat16", native_decode_step=False)
    assert got == generate(plain, n=n, temperature=temperature)


def test_bf16_engine_takes_the_native_step_close_to_its_module_path():
    """Prompt logprobs through two layers of the tiny model (a short prompt runs in the native step too): within
    0.05 of the module path's bf16, where bf16 itself moves them by ~1e-2 from fp32 and a step that read the pool
    wrongly or skipped a layer's rounding of K/V would move them by ~1e-1 or more."""
    model = variant("qwen3")
    sp = SamplingParams(max_tokens=1, prompt_logprobs=2)
    native_llm = make_llm(model, compute_dtype="bfloat16")
    native = native_llm.generate(["9:;<=>?"], sp)[0].prompt_logprobs
    runner = native_llm.engine.runner
    assert runner.native_decode.steps == 1 and runner.kv_caches[0].dtype == torch.bfloat16
    plain = make_llm(model, compute_dtype="bfloat16", native_decode_step=False).generate(["9:;<=>?"], sp)
    fp32 = make_llm(model).generate(["9:;<=>?"], sp)[0].prompt_logprobs
    native, plain, fp32 = (torch.tensor(lp[1:]) for lp in (native, plain[0].prompt_logprobs, fp32))
    torch.testing.assert_close(native, plain, atol=0.05, rtol=0)
    assert (native - fp32).abs().max() > 0  # it computed in bf16, not fp32


def test_bf16_decode_steps_run_natively_and_follow_an_in_place_update():
    """Decode steps of 6 sequences go through the native step over the bf16 copies; an optimizer-style in-place step
    makes the copies stale: the next step reads fresh ones (the outputs move as the module path's do)."""
    model = variant("llama")
    llm = make_llm(model, compute_dtype="bfloat16")
    before = generate(llm, temperature=0.0)
    steps = llm.engine.runner.native_decode.steps
    assert steps >= 10
    made = llm.engine.runner.bf16_weights.num_copies_made
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    after = generate(llm, temperature=0.0)  # no weights_updated(): the version counter alone must be seen
    assert llm.engine.runner.native_decode.steps >= steps + 10
    assert llm.engine.runner.bf16_weights.num_copies_made == made + 1  # only the weight that moved
    assert after != before


def test_bf16_decode_steps_past_max_rows_run_natively_but_prompts_do_not():
    """Past MAX_ROWS only decode steps take the bf16 native step: a prompt of more tokens (each a query of its own
    there, not the module path's masked SDPA) stays on the modules."""
    llm = make_llm(variant("llama"), compute_dtype="bfloat16")
    native = llm.engine.runner.native_decode
    llm.generate(["0123456789"], SamplingParams(max_tokens=1))
    assert native.steps == 0  # a 10-token prompt: the modules
    llm.generate(["12"], SamplingParams(max_tokens=4, ignore_eos=True, n=MAX_ROWS + 4, seed=0))
    assert native.steps == 1 + 3  # the 2-token prompt and 3 decode steps of 12 rows


def test_a_mixed_table_built_by_a_wide_step_keeps_the_int8_choices_of_the_steps_it_runs():
    """int8 layers in a bf16 engine cap the table at MAX_ROWS. Built first by a 48-row decode step, it still holds
    the int8 kernels chosen for MAX_ROWS rows (one may have no native kernel at 48), so narrower steps run on it."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(tiny_model().config, hidden_size=64, num_attention_heads=8)).eval()
    quantize_for_inference(model, "int8")
    llm = make_llm(model, compute_dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=64, num_kv_blocks=512)
    native = llm.engine.runner.native_decode
    prompt = "abcdefghijklmnopqrstuvwxyz" * 2  # 52 tokens: the modules, where the table is never built
    llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, n=48, seed=7))
    table = native._table
    assert native.steps == 0 and table is not None and table.max_rows == MAX_ROWS
    got = llm.generate(["ab"], SamplingParams(max_tokens=4, ignore_eos=True, n=2, seed=7))
    assert native.steps == 4 and native._table is table  # the prompt and 3 decode steps, on the same table
    plain = make_llm(model, compute_dtype="bfloat16", native_decode_step=False)
    want = plain.generate(["ab"], SamplingParams(max_tokens=4, ignore_eos=True, n=2, seed=7))
    assert [o.outputs for o in got] == [o.outputs for o in want]

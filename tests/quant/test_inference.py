"""int8 weight-only decode for the inference commands: the C kernel against the scheme's reference, the kernel
choice by CPU capability, the engine over int8 weights against the engine over their dequantized fp32 copy, and
the `quant` option's checks (LLM, CLI)."""

from __future__ import annotations

import pytest
import torch

from posttrain import kernels
from posttrain.cli import main as cli_main
from posttrain.engine import LLM, SamplingParams
from posttrain.errors import PosttrainError
from posttrain.quant import QuantizedLinear, dequantize_model, set_compute
from posttrain.quant.codec import fake_quantize_activations
from posttrain.quant.inference import quantize_for_inference, weight_bytes
from posttrain.quant.linear import NATIVE_MAX_ROWS
from tests.numeric import REORDER_RTOL, reorder_rtol
from tests.quant.tiny import char_tokenizer, tiny_model, write_tiny_dir

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="the native CPU kernels are not built here")


def int8_layer(out_features: int, in_features: int, seed: int = 0, scheme: str = "int8") -> QuantizedLinear:
    torch.manual_seed(seed)
    return QuantizedLinear.from_linear(torch.nn.Linear(in_features, out_features, bias=False), scheme)


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8", "int8-g32"])
@pytest.mark.parametrize("rows", [1, 3, 5, NATIVE_MAX_ROWS])
# 30 rows: a last block of 2; K = 100: a tail of 4 codes, and with groups of 32 a last group of 4
@pytest.mark.parametrize("shape", [(64, 576), (30, 100)])
def test_native_int8_kernel_matches_the_reference(scheme: str, rows: int, shape: tuple[int, int]):
    layer = int8_layer(*shape, scheme=scheme)
    x = torch.randn(rows, shape[1])
    assert layer.kernel_for(x).name == "cpu_int8_native"  # tests/conftest.py pins an AVX2 CPU (no fast bf16)
    y = layer(x)
    weight = layer.dequantize()
    reference = torch.nn.functional.linear(x, weight)  # the scheme's exact semantics
    # One sum of K products in another order (and the scale applied after it, or to the code before it: one
    # rounding more per term), relative to the size of the terms.
    bound = reorder_rtol(2, shape[1]) * (x.abs() @ weight.abs().t()).max()
    assert (y - reference).abs().max() <= bound


@needs_kernels
def test_grouped_int8_uses_each_groups_own_scale():
    """Groups of 32 with very different magnitudes: a kernel that used one scale per row (or the wrong group's)
    would be off by about the ratio between them, far past the rounding bound."""
    torch.manual_seed(1)
    weight = torch.randn(8, 96) * torch.tensor([1e-2, 1.0, 30.0]).repeat_interleave(32)  # 3 groups per row
    layer = QuantizedLinear.from_float(weight, None, "int8-g32")
    x = torch.randn(NATIVE_MAX_ROWS, 96)
    assert layer.kernel_for(x).name == "cpu_int8_native"
    assert layer.kernel_for(torch.randn(NATIVE_MAX_ROWS + 1, 96)).name == "reference"  # prefill: dequantize
    reference = torch.nn.functional.linear(x, layer.dequantize())
    assert (layer(x) - reference).abs().max() <= reorder_rtol(2, 96) * (x.abs() @ weight.abs().t()).max()
    # The grid itself: each weight within half a step of its own group's grid, plus the fp16 scale's rounding
    # (128 steps x 2^-11 relative: 1/16 of a step); on one grid per row the small groups would be off by far more.
    step = weight.view(8, 3, 32).abs().amax(dim=-1, keepdim=True) / 128  # (8, 3, 1)
    assert ((layer.dequantize() - weight).view(8, 3, 32).abs() <= step * (0.5 + 1 / 16)).all()


@needs_kernels
@pytest.mark.parametrize(
    "rows", [1, 2, 3, 5, NATIVE_MAX_ROWS, 95]
)  # streamed rows (1-3), blocks, a prefill (odd last input)
@pytest.mark.parametrize("shape", [(64, 576), (30, 96)])  # 30 rows: a last block of 2; 96: an odd 3rd group
def test_q8_kernel_matches_its_reference(kernel_march: str, rows: int, shape: tuple[int, int]):
    """For this CPU's build (AVX512-VNNI's vpdpbusd where it has it) and AVX2's: llama.cpp's Q8_0 product: the C kernel rounds the activations to int8 per group of 32 exactly as
    `quantize_per_group` does (the same codes), sums the products in integers (exact) and scales each group's sum:
    within the reordering of the fp32 sum over groups of the reference (fake-quantized activations times the
    dequantized weight). One activation code rounded differently would move a result by a whole step (~1/127 of
    its group's largest input times a weight), far past this bound."""
    layer = int8_layer(*shape, scheme="q8_0")
    x = torch.randn(rows, shape[1])
    assert layer.kernel_for(x).name == "cpu_q8_native"
    y = layer(x)
    rounded = fake_quantize_activations(x, layer.scheme)
    weight = layer.dequantize()
    reference = torch.nn.functional.linear(rounded, weight)
    assert (y - reference).abs().max() <= reorder_rtol(2, shape[1]) * (rounded.abs() @ weight.abs().t()).max()
    assert (y - torch.nn.functional.linear(x, weight)).abs().max() > 0  # the activations were rounded


@needs_kernels
def test_q8_kernel_scales_activations_per_group():
    """Inputs and weights whose groups of 32 differ by 1e6 in size, so each group adds as much to the result: one
    activation scale per token would round the small group's inputs to zero and lose a third of every output."""
    torch.manual_seed(2)
    weight = torch.randn(8, 96) * torch.tensor([1e3, 1.0, 1e-3]).repeat_interleave(32)
    layer = QuantizedLinear.from_float(weight, None, "q8_0")
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(32)
    assert layer.kernel_for(x).name == "cpu_q8_native"
    exact = torch.nn.functional.linear(x, weight)
    # Each factor off by at most half a step of its own group's grid (the weights' fp16 scale adds 1/16 of a step).
    x_err = (x.view(3, 3, 32).abs().amax(-1, keepdim=True) / 127 / 2).expand(3, 3, 32).reshape(3, 96)
    w_err = (weight.view(8, 3, 32).abs().amax(-1, keepdim=True) / 128 * (0.5 + 1 / 16)).expand(8, 3, 32).reshape(8, 96)
    bound = x_err @ weight.abs().t() + x.abs() @ w_err.t() + x_err @ w_err.t()
    assert ((layer(x) - exact).abs() <= bound * (1 + 1e-3)).all()
    assert layer.kernel_for(torch.randn(300, 96)).name == "cpu_q8_native"  # prefill too
    assert QuantizedLinear.from_float(weight[:, :80], None, "q8_0").kernel_for(x[:, :80]).name == "reference"


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5])
def test_q8_kernel_rounds_activation_ties_to_even(kernel_march: str, rows: int):
    """A group whose largest input is 127 has the scale 1, so 0.5, 1.5, 2.5, ... fall halfway between two codes:
    they round to the even one (torch.round's rule, which `quantize_per_group` uses), where rounding half away from
    zero would give 1, 3, -1, -3. One-hot weight rows read each activation code back."""
    x = torch.zeros(rows, 32)
    x[:, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    layer = QuantizedLinear.from_float(torch.eye(8, 32), None, "q8_0")
    assert layer.kernel_for(x).name == "cpu_q8_native"
    weight = layer.dequantize().diagonal()  # (8,): each row's one weight
    codes = torch.tensor([127.0, 0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 4.0])
    torch.testing.assert_close(layer(x), (codes * weight).expand(rows, 8), rtol=1e-6, atol=0)


def test_kernel_choice_follows_the_cpu(monkeypatch: pytest.MonkeyPatch):
    layer = int8_layer(64, 576)
    decode, prefill = torch.randn(2, 576), torch.randn(NATIVE_MAX_ROWS + 1, 576)
    if kernels.library() is not None:
        assert layer.kernel_for(decode).name == "cpu_int8_native"
    assert layer.kernel_for(prefill).name == "cpu_int8_bf16"  # past decode sizes: torch's kernel
    monkeypatch.setenv("POSTTRAIN_CPU_FEATURES", "avx2,avx512f,avx512_bf16")  # fast bf16: torch's kernel throughout
    assert layer.kernel_for(decode).name == "cpu_int8_bf16"
    asym = QuantizedLinear.from_linear(torch.nn.Linear(576, 64, bias=False), "int8-asym")
    monkeypatch.setenv("POSTTRAIN_CPU_FEATURES", "avx2")
    assert asym.kernel_for(decode).name != "cpu_int8_native"  # the C kernel has no zero point


@needs_kernels
def test_int8_engine_matches_the_engine_over_the_dequantized_weights(tmp_path):
    """Weight-only quantization at load time changes the weights, nothing else: the int8 engine's greedy tokens and
    logprobs are those of the fp32 engine over the same weights dequantized, within float rounding."""
    path = write_tiny_dir(tmp_path / "tiny")
    int8 = LLM(str(path), quant="int8", num_kv_blocks=64, block_size=4)
    model = int8.engine.model
    assert all(isinstance(m, QuantizedLinear) for n, m in model.named_modules() if n.endswith("_proj"))
    assert not isinstance(model.lm_head, QuantizedLinear)
    dequantized = dequantize_model(quantize_for_inference(tiny_model(), "int8"))
    fp32 = LLM(dequantized, char_tokenizer(), num_kv_blocks=64, block_size=4)
    assert_same_generations(int8, fp32, REORDER_RTOL)


@needs_kernels
def test_q8_0_engine_matches_its_reference_kernels(tmp_path):
    """q8_0 rounds the activations too, as llama.cpp's Q8_0 product does, and the LM head (the embedding it may be
    tied to stays fp32): the engine on the C kernels gives the greedy tokens of the same quantized model on the
    reference kernels (fake-quantized activations times dequantized weights). Their logprobs agree to rounding,
    except where an input lands on the other side of an activation rounding boundary on one path (inputs apart
    by a reordering): that moves a logit by about one step of 1/127, so 1e-2 is allowed."""
    path = write_tiny_dir(tmp_path / "tiny")
    q8 = LLM(str(path), quant="q8_0", num_kv_blocks=64, block_size=4)
    model = q8.engine.model
    assert isinstance(model.lm_head, QuantizedLinear) and model.embed_tokens.weight.dtype == torch.float32
    assert {m.scheme.name for m in model.modules() if isinstance(m, QuantizedLinear)} == {"q8_0"}
    reference = set_compute(quantize_for_inference(tiny_model(), "q8_0"), "reference")
    assert_same_generations(q8, LLM(reference, char_tokenizer(), num_kv_blocks=64, block_size=4), 1e-2)
    assert q8.engine.runner.native_decode.steps > 0  # the decode steps ran q8_linear.c from the native step


def assert_same_generations(llm: LLM, other: LLM, rtol: float) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
    prompts = ["hello there", "2+2=", "x"]
    for got, want in zip(llm.generate(prompts, params), other.generate(prompts, params)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert abs(a - b) <= rtol * max(1.0, abs(b))


def test_int8_weights_take_about_a_quarter_of_the_bytes():
    model = tiny_model()
    embedding = model.embed_tokens.weight.numel() * 4 + sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)
    before = weight_bytes(model) - embedding
    after = weight_bytes(quantize_for_inference(model, "int8")) - embedding
    linear_weights = before // 4  # fp32 values of the decoder linears
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.scheme.name == "int8-g32" for m in layers)  # `int8` for inference: llama.cpp's Q8_0 grid
    # One byte per weight, and an fp16 scale per group of 32 along each row (a last group may be shorter).
    assert after == linear_weights + sum(2 * m.out_features * -(-m.in_features // 32) for m in layers)
    assert not any(p.requires_grad for p in model.parameters())


def test_quant_refuses_a_live_module_and_unknown_schemes(tmp_path):
    with pytest.raises(PosttrainError, match="live module"):
        LLM(tiny_model(), char_tokenizer(), quant="int8")
    with pytest.raises(PosttrainError, match="quant='int4': the inference commands take int8, q8_0"):
        LLM(str(tmp_path / "unused"), quant="int4")  # checked before anything loads


def test_generate_cli_takes_quant(tmp_path, capsys):
    path = write_tiny_dir(tmp_path / "tiny")
    argv = ["generate", "--model", str(path), "--prompt", "hi", "--raw", "--max-tokens", "3", "--temperature", "0"]
    assert cli_main([*argv, "--quant", "int8"]) == 0
    assert cli_main([*argv, "--quant", "fp8"]) != 0
    assert "quant='fp8'" in capsys.readouterr().err

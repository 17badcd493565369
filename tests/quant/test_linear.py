"""QuantizedLinear against nn.Linear, its kernels against the reference path, gradients, whole models."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain import kernels
from posttrain.errors import PosttrainError
from posttrain.quant import SCHEMES, QuantizedLinear, dequantize_model, get_scheme, linear, quantize_model, set_compute
from posttrain.quant.linear import cpu_int4_layout_matches, int_mm_is_exact
from tests.quant.tiny import tiny_model

# Relative output error vs the fp32 layer on Gaussian weights and inputs (RTN, measured ~0.5% / ~7%).
OUTPUT_TOLERANCE = {8: 0.015, 4: 0.12}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def gaussian_linear(in_features: int, out_features: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, in_features**-0.5)
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("shape", [(3, 5), (7,)], ids=["dense (B,T,d)", "paged (N,d)"])
def test_output_close_to_fp32_and_kernel_close_to_reference(name, shape):
    fp32 = gaussian_linear(576, 192, bias=True)
    layer = QuantizedLinear.from_linear(fp32, name)
    x = torch.randn(*shape, 576)
    y = layer(x)
    assert y.shape == (*shape, 192) and y.dtype == torch.float32
    assert rel(y, fp32(x)) < OUTPUT_TOLERANCE[get_scheme(name).bits]
    layer.compute = "reference"
    reference = layer(x)
    # The reference path is exactly "dequantize, then F.linear" (W8A8: with per-token rounded inputs).
    if get_scheme(name).activation_bits is None:
        assert torch.equal(reference, F.linear(x, layer.dequantize()) + layer.bias)
    # Fused kernels round activations to bf16 (a few 1e-3 relative); int_mm accumulates exactly.
    assert rel(y, reference) < 6e-3


def test_cpu_kernel_choice():
    x = torch.randn(4, 576)
    w8a8 = QuantizedLinear.from_linear(gaussian_linear(576, 64), "w8a8").kernel_for(x).name
    assert w8a8 == ("int_mm" if int_mm_is_exact() else "reference")
    int8 = QuantizedLinear.from_linear(gaussian_linear(576, 64), "int8").kernel_for(x).name
    assert int8 == ("cpu_int8_native" if kernels.library() is not None else "cpu_int8_bf16")  # AVX2: no fast bf16
    int4 = QuantizedLinear.from_linear(gaussian_linear(576, 64), "int4-g128")  # 576 = 4 x 128 + 64: kernel groups of 64
    assert int4.kernel_for(x).name == ("cpu_int4_bf16" if cpu_int4_layout_matches() else "reference")
    odd = QuantizedLinear.from_linear(gaussian_linear(80, 64), "int4-g32")  # 80 is not a multiple of 32
    assert odd.kernel_for(torch.randn(2, 80)).name == "reference"
    assert torch.allclose(odd(torch.ones(2, 80)), F.linear(torch.ones(2, 80), odd.dequantize()))
    int4.compute = "reference"
    assert int4.kernel_for(x).name == "reference"


def test_cpu_int4_layout_matches_torch():
    """Our tiles64 layout is the one torch packs int4 in for its AVX-512 kernels; its AVX2 ones pack another, and
    int4 layers take the reference kernel there (test_kernels_on_a_cpu_without_avx512_or_vnni)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"torch runs its {torch.backends.cpu.get_cpu_capability()} kernels here")
    assert cpu_int4_layout_matches(), "torch's CPU int4 kernel no longer reads our layout: it falls back to reference"


def test_w8a8_takes_int_mm_only_where_it_is_exact(monkeypatch: pytest.MonkeyPatch):
    layer, x = QuantizedLinear.from_linear(gaussian_linear(576, 64), "w8a8"), torch.randn(4, 576)
    for exact, kernel in ((True, "int_mm"), (False, "reference")):
        monkeypatch.setattr(linear, "int_mm_is_exact", lambda exact=exact: exact)
        assert layer.kernel_for(x).name == kernel


# Run in a fresh interpreter: what each scheme's kernel and output are with torch's kernels for AVX2 and oneDNN
# kept from VNNI and AVX-512 (the settings are read when torch loads).
_AVX2_PROBE = """
import json, torch
from posttrain.quant import SCHEMES, QuantizedLinear
from posttrain.quant.linear import cpu_int4_layout_matches, int_mm_is_exact
torch.manual_seed(0)
fp32 = torch.nn.Linear(576, 192)
x = torch.randn(7, 576)
out = {"capability": torch.backends.cpu.get_cpu_capability(), "int_mm_exact": int_mm_is_exact(),
       "int4_layout": cpu_int4_layout_matches(), "schemes": {}}
for name in SCHEMES:
    layer = QuantizedLinear.from_linear(fp32, name)
    kernel, y = layer.kernel_for(x).name, layer(x)
    layer.compute = "reference"
    reference = layer(x)
    out["schemes"][name] = [kernel, ((y - reference).norm() / reference.norm()).item()]
print(json.dumps(out))
"""


def test_kernels_on_a_cpu_without_avx512_or_vnni():
    """On an AVX2-only CPU every scheme still computes what its reference kernel does: int4 falls back (torch's
    AVX2 packing is not our layout), W8A8 too where `_int_mm` saturates, and the bf16 kernels stay within bf16's
    rounding. This machine's own kernels are the other tests'; here torch and oneDNN are held to AVX2."""
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    done = subprocess.run([sys.executable, "-c", _AVX2_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout)
    if probe["capability"] not in ("AVX2", "DEFAULT"):
        pytest.skip(f"torch would not run its AVX2 kernels here ({probe['capability']})")
    for name, (kernel, error) in probe["schemes"].items():
        assert error < 6e-3, (name, kernel, error)  # bf16 activations: a few 1e-3; reference and exact int_mm: ~0
        if get_scheme(name).bits == 4:
            assert kernel == ("cpu_int4_bf16" if probe["int4_layout"] else "reference"), name
        if name == "w8a8":
            assert kernel == ("int_mm" if probe["int_mm_exact"] else "reference")


@pytest.mark.parametrize("name", ["int4-g128-asym", "int8-asym"])
def test_rows_not_a_multiple_of_64_and_bias(name):
    fp32 = gaussian_linear(128, 100, bias=True)  # 100 rows: int4 pads the last tile
    layer = QuantizedLinear.from_linear(fp32, name)
    x = torch.randn(9, 128)
    layer.compute = "reference"
    reference = layer(x)
    layer.compute = "auto"
    assert rel(layer(x), reference) < 6e-3 and rel(reference, fp32(x)) < OUTPUT_TOLERANCE[get_scheme(name).bits]


def test_resident_bytes_are_small():
    int4 = QuantizedLinear.from_linear(gaussian_linear(1536, 576), "int4-g128")
    assert int4.qweight.nbytes == 576 * 1536 // 2  # two codes per byte
    assert int4.scales.nbytes == 576 * 12 * 2 and int4.zeros is None  # fp16 scale per group of 128
    assert not list(int4.parameters())  # frozen: buffers only
    int8 = QuantizedLinear.from_linear(gaussian_linear(1536, 576), "int8")
    assert int8.qweight.nbytes == 576 * 1536 and int8.scales.nbytes == 576 * 4


@pytest.mark.parametrize("name", ["int4-g64", "int8-asym", "w8a8"])
@pytest.mark.parametrize("compute", ["auto", "reference"])
def test_gradient_reaches_the_input_through_the_dequantized_weight(name, compute):
    layer = QuantizedLinear.from_linear(gaussian_linear(128, 64, bias=True), name, compute=compute)
    x = torch.randn(2, 3, 128, requires_grad=True)
    grad_out = torch.randn(2, 3, 64)
    (layer(x) * grad_out).sum().backward()  # backward(grad) would import sympy (seconds) to compare shapes
    assert torch.allclose(x.grad, grad_out @ layer.dequantize(), atol=1e-5)
    assert layer.qweight.grad is None and layer.scales.grad is None


def test_usable_as_the_frozen_base_of_lora():
    lora_layer = pytest.importorskip("posttrain.peft.lora_layer")
    base = QuantizedLinear.from_linear(gaussian_linear(64, 32), "int4-g32")
    lora = lora_layer.LoRALinear(base, "layers.0.self_attn.q_proj")
    lora.add_adapter("default", r=4, alpha=8)
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_()
    x = torch.randn(5, 64, requires_grad=True)
    lora(x).sum().backward()
    assert lora.lora_A["default"].weight.grad is not None and lora.lora_B["default"].weight.grad is not None
    assert x.grad is not None and [n for n, p in lora.named_parameters() if p.requires_grad] == [
        "lora_A.default.weight",
        "lora_B.default.weight",
    ]


def test_casting_the_model_keeps_scales_exact(model):
    quantize_model(model, "int4-g32-asym")
    layer = model.layers[0].mlp.up_proj
    scales, zeros = layer.scales.clone(), layer.zeros.clone()
    model.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and torch.equal(layer.scales, scales) and torch.equal(layer.zeros, zeros)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(torch.randint(0, 128, (1, 5))).dtype == torch.float32  # logits are cast to fp32
    assert layer(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_input_width_and_compute_mode():
    layer = QuantizedLinear.from_linear(gaussian_linear(64, 32), "int8")
    with pytest.raises(ValueError, match="input has 63 features, the layer expects 64"):
        layer(torch.randn(2, 63))
    with pytest.raises(PosttrainError, match="unknown compute mode 'fast'"):
        QuantizedLinear(64, 32, "int8", compute="fast")


# ---- whole models -----------------------------------------------------------------------------------------------

DECODER_LINEARS = {
    f"layers.{i}.{m}"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


@pytest.mark.parametrize("name", ["int8", "int4-g32", "w8a8"])
def test_quantize_model_replaces_decoder_linears_only(model, name):
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model(ids)
    quantize_model(model, name)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized == DECODER_LINEARS
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight  # tied, fp32
    assert model.config.extra["quantization_config"]["scheme"] == name
    with torch.no_grad():
        logits = model(ids)
    assert rel(logits, expected) < (0.03 if get_scheme(name).bits == 8 else 0.15)


def test_quantize_model_refuses_twice_and_wrapped_layers(model):
    quantize_model(model, "int8")
    with pytest.raises(PosttrainError, match="layers.0.self_attn.q_proj is already quantized"):
        quantize_model(model, "int8")
    with pytest.raises(PosttrainError, match="unknown quantization scheme 'int5'"):
        quantize_model(tiny_model(), "int5")
    with pytest.raises(PosttrainError, match="no decoder linear layers"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int8")
    wrapped = tiny_model()
    wrapped.layers[0].mlp.up_proj = type("LoRALinear", (nn.Module,), {})()
    with pytest.raises(PosttrainError, match="layers.0.mlp.up_proj is a LoRALinear, not nn.Linear"):
        quantize_model(wrapped, "int8")


def test_dequantize_model_is_the_reference_computation(model):
    quantize_model(model, "int4-g32-asym")
    ids = torch.randint(0, 128, (2, 9))
    set_compute(model, "reference")
    with torch.no_grad():
        reference = model(ids)
        dequantize_model(model)
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
        assert "quantization_config" not in model.config.extra
        assert torch.allclose(model(ids), reference, atol=1e-5)


def test_engine_style_flat_input_matches_dense(model):
    quantize_model(model, "int4-g64")
    layer = model.layers[0].mlp.gate_proj
    x = torch.randn(2, 6, 64)
    assert torch.equal(layer(x).reshape(12, -1), layer(x.reshape(12, 64)))
    assert copy.deepcopy(layer)(x).equal(layer(x))

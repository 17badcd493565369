"""Weight-only int8 / int4 quantization, W8A8, and quantization-aware training.

    from posttrain.quant import quantize_model, save_quantized
    model = quantize_model(model, "int4-g128")       # decoder linears -> QuantizedLinear, in place
    gptq_quantize_model(model, "int4-g128", calibration_batch(rows, 128, 512))  # or: GPTQ on calibration text
    save_quantized(model, "out/smollm2-int4", tokenizer)

Schemes live in one registry (`SCHEMES`): int8, int8-asym, w8a8, int4-g{32,64,128}[-asym].
"""

from posttrain.quant.codec import dequantize_weight, fake_quantize, pack_int4, quantize_weight, unpack_int4
from posttrain.quant.gptq import GPTQResult, gptq_quantize
from posttrain.quant.gptq_model import calibration_batch, gptq_quantize_model
from posttrain.quant.io import is_quantized_dir, load_quantized, load_quantized_dir, save_quantized
from posttrain.quant.linear import KERNELS, QuantizedLinear, dequantize_model, quantize_model, set_compute
from posttrain.quant.qat import FakeQuantLinear, convert_qat, prepare_qat
from posttrain.quant.schemes import SCHEMES, QuantScheme, get_scheme

__all__ = [
    "SCHEMES",
    "QuantScheme",
    "get_scheme",
    "QuantizedLinear",
    "KERNELS",
    "quantize_model",
    "dequantize_model",
    "set_compute",
    "gptq_quantize",
    "GPTQResult",
    "gptq_quantize_model",
    "calibration_batch",
    "FakeQuantLinear",
    "prepare_qat",
    "convert_qat",
    "save_quantized",
    "load_quantized",
    "load_quantized_dir",
    "is_quantized_dir",
    "quantize_weight",
    "dequantize_weight",
    "fake_quantize",
    "pack_int4",
    "unpack_int4",
]

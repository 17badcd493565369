"""Quantization-aware training: fake quantization with a straight-through estimator.

`prepare_qat(model, scheme)` swaps each decoder linear for a FakeQuantLinear that keeps the SAME weight
Parameter (an optimizer built before or after sees one tensor) and computes with the weight quantized and
dequantized on the fly; the gradient passes the rounding unchanged (straight-through: d w_q / d w = 1; the
absmax / min-max grids never clip, so there is nothing to mask). For W8A8 the input is fake-quantized per
token the same way. `convert_qat(model)` then writes the real int8 / int4 layers, which are exactly what
`quantize_model` makes from the trained weights: both call the same `quantize_weight`.

A QAT model saves as a plain float checkpoint (FakeQuantLinear's state is nn.Linear's: weight, bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.errors import PosttrainError
from posttrain.quant.codec import fake_quantize, fake_quantize_activations
from posttrain.quant.linear import QuantizedLinear, decoder_linear_names, replace_module
from posttrain.quant.schemes import QuantScheme, get_scheme


class _StraightThrough(torch.autograd.Function):
    """Forward: round(t) through the scheme; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, rounding) -> torch.Tensor:  # type: ignore[override]
        return rounding(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class FakeQuantLinear(nn.Module):
    """nn.Linear whose forward uses fake_quantize(weight) (and, for W8A8, per-token fake-quantized inputs)."""

    def __init__(self, linear: nn.Linear, scheme: str | QuantScheme) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter objects, not copies
        self.bias = linear.bias

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the converted layer will hold it, with straight-through gradient."""
        return _StraightThrough.apply(self.weight, lambda w: fake_quantize(w, self.scheme))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activation_bits is not None:
            x = _StraightThrough.apply(x, lambda t: fake_quantize_activations(t, self.scheme))
        return F.linear(x, self.quantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"bias={self.bias is not None}"
        )


def prepare_qat(model: nn.Module, scheme: str | QuantScheme) -> nn.Module:
    """Swap every decoder linear for a FakeQuantLinear, in place (lm_head and embeddings untouched)."""
    scheme = get_scheme(scheme)
    names = decoder_linear_names(model)
    if not names:
        raise PosttrainError("prepare_qat: the model has no decoder linear layers (layers.N.self_attn.q_proj ...)")
    for name in names:
        module = model.get_submodule(name)
        if type(module) is not nn.Linear:
            raise PosttrainError(f"prepare_qat: {name} is a {type(module).__name__}, not nn.Linear")
        replace_module(model, name, FakeQuantLinear(module, scheme))
    return model


def convert_qat(model: nn.Module, compute: str = "auto") -> nn.Module:
    """Replace every FakeQuantLinear with the real QuantizedLinear of its current weight, in place."""
    names = [name for name, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    if not names:
        raise PosttrainError("convert_qat: the model has no FakeQuantLinear layers (call prepare_qat first)")
    schemes = set()
    for name in names:
        fq = model.get_submodule(name)
        schemes.add(fq.scheme)
        replace_module(model, name, QuantizedLinear.from_float(fq.weight, fq.bias, fq.scheme, compute, source=name))
    config = getattr(model, "config", None)
    if len(schemes) == 1 and config is not None and hasattr(config, "extra"):
        config.extra["quantization_config"] = schemes.pop().to_config()
    return model

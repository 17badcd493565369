"""Quantization schemes: what a name like `int4-g128-asym` means, as data in one registry.

A scheme fixes the weight format (bits, group size, symmetric or with a zero point) and whether the
activations are quantized too: dynamic int8 with one absmax scale per token (`w8a8`: per-channel weights) or
per group of the weights' group size along the input (`q8_0`: llama.cpp's Q8_0 x Q8_0 product, groups of 32).
Round-to-nearest throughout.

Weight value of a stored code q (centred: q = code - 2**(bits-1), in [-8, 7] for int4, [-128, 127] for
int8) in group g of output channel n:

    w = q * scales[n, g]                      symmetric
    w = q * scales[n, g] + zeros[n, g]        asymmetric

Symmetric: scale = (the group's value of largest magnitude) / -2**(bits-1), so that value is exactly code
-8 (-128) and all 16 (256) codes are in use; the scale is negative when that value is positive. This is
llama.cpp's Q4_0 rule; the textbook absmax / 7 grid leaves code -8 unused and measured 14% more RMS
error on SmolLM2-135M's weights at group 128.
Asymmetric: scale = (max - min) / (2**bits - 1) and a float zero point in weight units (the value of
centred code 0, as llama.cpp's Q4_1 `min` and torch's int4 kernels keep it), not an integer code: the
group's minimum and maximum are then both on the grid, which an integer zero point cannot promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.errors import PosttrainError


@dataclass(frozen=True)
class QuantScheme:
    name: str
    bits: int  # 8 or 4
    group_size: int | None  # weights per scale along in_features; None = one group per output channel
    symmetric: bool
    # 8 = dynamic int8 activations, one scale per token (group_size None) or per group of group_size along the
    # input (the weights' groups); None = weight-only
    activation_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in WEIGHT_BITS:
            raise PosttrainError(f"scheme {self.name!r}: bits={self.bits} (supported: {sorted(WEIGHT_BITS)})")
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2
        ):
            raise PosttrainError(f"scheme {self.name!r}: group_size={self.group_size!r} must be an integer >= 2")
        if self.activation_bits not in (None, 8):
            raise PosttrainError(f"scheme {self.name!r}: activation_bits={self.activation_bits!r} (supported: 8)")
        if self.activation_bits is not None and (self.bits != 8 or not self.symmetric):
            raise PosttrainError(f"scheme {self.name!r}: int8 activations need symmetric int8 weights")

    @property
    def mid(self) -> int:
        """The unsigned code that stands for zero (symmetric) or for the zero point (asymmetric): 2**(bits-1)."""
        return 1 << (self.bits - 1)

    @property
    def q_min(self) -> int:
        """Smallest centred code: -8 for int4, -128 for int8."""
        return -self.mid

    @property
    def q_max(self) -> int:
        return self.mid - 1

    @property
    def scale_dtype(self) -> torch.dtype:
        """fp32 for per-channel scales (one per row: free); fp16 for group scales, where 32 bits per group of
        32 would cost a whole bit per weight."""
        return torch.float32 if self.group_size is None else torch.float16

    def num_groups(self, in_features: int) -> int:
        """Groups per row. A last group shorter than group_size is allowed (576 = 4 x 128 + 64)."""
        return 1 if self.group_size is None else -(-in_features // self.group_size)

    def effective_group_size(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def to_config(self) -> dict:
        """The `quantization_config` section of a saved model's config.json."""
        return {
            "quant_method": QUANT_METHOD,
            "format_version": FORMAT_VERSION,
            "scheme": self.name,
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "activation_bits": self.activation_bits,
            "int4_layout": INT4_LAYOUT if self.bits == 4 else None,
            "scale_dtype": str(self.scale_dtype).removeprefix("torch."),
            "modules_not_converted": ["lm_head", "embed_tokens"],
        }


WEIGHT_BITS = {8: torch.int8, 4: torch.uint8}  # bits -> storage dtype of `qweight`
QUANT_METHOD = "posttrain"
FORMAT_VERSION = 1
INT4_LAYOUT = "tiles64"  # see `posttrain.quant.codec.pack_int4`


def _int4(group: int, symmetric: bool) -> QuantScheme:
    return QuantScheme(f"int4-g{group}" + ("" if symmetric else "-asym"), 4, group, symmetric)


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        QuantScheme("int8", 8, None, True),
        QuantScheme("int8-g32", 8, 32, True),  # llama.cpp's Q8_0 grid: a scale per 32 weights
        QuantScheme("int8-asym", 8, None, False),
        QuantScheme("w8a8", 8, None, True, activation_bits=8),
        QuantScheme("q8_0", 8, 32, True, activation_bits=8),  # llama.cpp's Q8_0: weights and activations by 32
        *(_int4(g, sym) for g in (32, 64, 128) for sym in (True, False)),
    )
}


def get_scheme(scheme: str | QuantScheme) -> QuantScheme:
    """A scheme by name (or a QuantScheme passed through), with the list of names on a miss."""
    if isinstance(scheme, QuantScheme):
        return scheme
    if scheme not in SCHEMES:
        raise PosttrainError(f"unknown quantization scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
    return SCHEMES[scheme]

"""QuantizedLinear: a drop-in replacement for `nn.Linear` holding int8 / packed int4 weights.

Buffers (what is saved): `qweight` (int8 (N, K), or uint8 (ceil(N/64), K, 32) for int4, see
`codec.pack_int4`), `scales` (N, G), `zeros` (N, G) for asymmetric schemes only, `bias` (N,) if any.
Inputs of any leading shape: (B, T, K) on the dense path, (N, K) on the engine's paged path.

How the matmul runs is chosen per call from KERNELS (first one that supports the input):

- `cpu_int8_native`: symmetric int8 weight-only, fp32 inputs of at most NATIVE_MAX_ROWS rows (decode) on a
  CPU without fast bf16 (posttrain.hardware): posttrain's own C kernel (posttrain/kernels/int8_linear.c)
  widens the codes to float in registers, so the weight streams as int8 and the activations stay fp32.
  There torch's int8 kernel below would run on emulated bf16. Larger inputs (prefill) take the next kernel.
  Grouped int8 (`int8-g32`, llama.cpp's Q8_0 grid) takes it on every CPU (torch has no grouped int8 kernel);
  its prefill-sized inputs take `reference` (measured at 95 x 576 -> 1536: dequantize + fp32 matmul 1.9 ms, this
  kernel 3.7 ms, fp32 1.4 ms).
- `cpu_q8_native`: the `q8_0` scheme (llama.cpp's Q8_0: int8 weights and activations in groups of 32), fp32
  inputs of any number of rows: posttrain's C kernel (posttrain/kernels/q8_linear.c) rounds the activations to
  int8 per group and sums the products in integers. Measured over 28 SmolLM2 decoder weights on an AVX512-VNNI
  EPYC (2 threads): 16 / 64 / 256 rows in 4.9 / 16.5 / 59 ms, where dequantizing and an fp32 matmul take 42 / 51 /
  84 (the AVX2 build of the kernel: 6.0 / 21.5 / 76), so prefill and batched decode take it too.
- `cpu_int4_bf16`, `cpu_int8_bf16`: torch's fused CPU weight-only kernels; they read the packed weights
  as stored and take bf16 activations (the input is rounded to bf16, the output cast back). Measured on
  this CPU (AVX-512): 2-3x faster than an fp32 matmul for decode-sized inputs (a few rows), slower than
  fp32 for prefill-sized ones; their fp32-activation variants were 10-100x slower, so not used.
- `int_mm`: W8A8, per-token dynamic int8 activations times int8 weights with `torch._int_mm` (int32
  accumulation, exact); measured 1-3x faster than fp32 on this CPU (VNNI). Taken only where a probe finds it
  exact (`int_mm_is_exact`: without VNNI oneDNN's int8 GEMM saturates).
- `reference`: dequantize the weight (fp32 math, cast to the input dtype), then `F.linear`; for W8A8 and q8_0 the
  activations are fake-quantized first. Runs on any device; the exact semantics of the scheme. Measured
  5-10x slower than fp32 per call on CPU (it writes a full float weight every call): a fallback.

`compute="reference"` pins a layer to the reference kernel. Caching the dequantized weight instead would
run at fp32 speed at fp32 memory; `dequantize_model` does exactly that when it is wanted.

Backward (QLoRA): the layer is frozen; the gradient flows to the input through the dequantized weight,
recomputed in backward, so no float weight is kept alive between forward and backward.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posttrain import hardware, kernels
from posttrain.errors import PosttrainError
from posttrain.quant.codec import (
    TILE_ROWS,
    dequantize_weight,
    fake_quantize_activations,
    pack_int4,
    quantize_per_token,
    quantize_weight,
    unpack_int4,
)
from posttrain.quant.schemes import WEIGHT_BITS, QuantScheme, get_scheme

COMPUTE_MODES = ("auto", "reference")
NATIVE_MAX_ROWS = 16  # inputs up to this many rows take `cpu_int8_native`: past it the weight is re-read per 4 rows

# The linear layers of each decoder block, by our module names; lm_head and the embeddings are left alone.
DECODER_LINEAR = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored quantized by `scheme`. Frozen: no parameters, only buffers."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: str | QuantScheme,
        bias: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
        compute: str = "auto",
    ) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        self.in_features, self.out_features = in_features, out_features
        self.compute = check_compute(compute)
        N, K, G = out_features, in_features, self.scheme.num_groups(in_features)
        self.register_buffer(
            "qweight", torch.empty(qweight_shape(self.scheme, N, K), dtype=WEIGHT_BITS[self.scheme.bits], device=device)
        )
        self.register_buffer("scales", torch.ones(N, G, dtype=self.scheme.scale_dtype, device=device))
        zeros = None if self.scheme.symmetric else torch.zeros(N, G, dtype=self.scheme.scale_dtype, device=device)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", torch.zeros(N, dtype=bias_dtype, device=device) if bias else None)
        self._kernel_cache: dict[tuple, object] = {}  # derived tensors of the fused kernels, by (kernel, device)
        self.register_load_state_dict_post_hook(lambda module, _: module._after_load())

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scheme: str | QuantScheme,
        compute: str = "auto",
        source: str = "weight",
    ) -> QuantizedLinear:
        """Quantize a float weight (N, K) by rounding to nearest (and keep the bias as it is)."""
        codes, scales, zeros = quantize_weight(weight, get_scheme(scheme), source)
        return cls.from_codes(codes, scales, zeros, bias, scheme, compute, source)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
        scheme: str | QuantScheme,
        compute: str = "auto",
        source: str = "weight",
    ) -> QuantizedLinear:
        """A layer from already-rounded weights: centred codes (N, K), scales / zeros (N, G) (e.g. from GPTQ)."""
        scheme = get_scheme(scheme)
        N, K = codes.shape
        G = scheme.num_groups(K)
        if (
            scales.shape != (N, G)
            or (zeros is None) != scheme.symmetric
            or (zeros is not None and zeros.shape != (N, G))
        ):
            raise PosttrainError(
                f"{source}: grids {tuple(scales.shape)} / "
                f"{None if zeros is None else tuple(zeros.shape)} do not fit {scheme.name} codes {N}x{K}"
            )
        layer = cls(
            K, N, scheme, bias is not None, codes.device, bias.dtype if bias is not None else torch.float32, compute
        )
        with torch.no_grad():
            layer.qweight = pack_int4(codes) if scheme.bits == 4 else codes.to(torch.int8).contiguous()
            layer.scales.copy_(scales)
            if zeros is not None:
                layer.zeros.copy_(zeros)
            if bias is not None:
                layer.bias.copy_(bias.detach())
        return layer

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, scheme: str | QuantScheme, compute: str = "auto", source: str = "weight"
    ) -> QuantizedLinear:
        return cls.from_float(linear.weight, linear.bias, scheme, compute, source)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """`model.to(torch.bfloat16)` / `.half()` must not round the scales: they keep their dtype and values
        (moved to the new device); codes are integers and are never cast."""
        kept = {name: getattr(self, name) for name in ("scales", "zeros") if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                setattr(self, name, before.to(after.device))
        return self

    def _after_load(self) -> None:
        self._kernel_cache.clear()
        if self.qweight.device.type == "cpu" and not _aligned(self.qweight):
            self.qweight = self.qweight.clone()  # tensors read from safetensors may sit at any offset

    @property
    def weight(self) -> torch.Tensor:
        """The packed integer weight (what bitsandbytes' `Linear4bit.weight` is too): lets wrappers such
        as LoRALinear read the device, and see from the dtype that the base weight is not a float."""
        return self.qweight

    def codes(self) -> torch.Tensor:
        """Centred integer codes, int8 (N, K)."""
        return unpack_int4(self.qweight, self.out_features) if self.scheme.bits == 4 else self.qweight

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (N, K) this layer stands for."""
        return dequantize_weight(self.codes(), self.scales, self.zeros, self.scheme.group_size, dtype)

    def kernel_for(self, x2d: torch.Tensor) -> Kernel:
        """The kernel a (M, K) input would run on."""
        names = ("reference",) if self.compute == "reference" else KERNEL_ORDER
        return next(KERNELS[n] for n in names if KERNELS[n].supports(self, x2d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantizedLinear: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        x2d = x.reshape(-1, self.in_features)  # (M, K)
        kernel = self.kernel_for(x2d)
        if x.requires_grad and torch.is_grad_enabled():
            y = _FrozenQuantizedMatmul.apply(x2d, self, kernel)
        else:
            y = kernel.matmul(self, x2d)  # (M, N)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"bias={self.bias is not None}, compute={self.compute}"
        )


def qweight_shape(scheme: QuantScheme, out_features: int, in_features: int) -> tuple[int, ...]:
    if scheme.bits == 4:
        return (-(-out_features // TILE_ROWS), in_features, 32)
    return (out_features, in_features)


def check_compute(compute: str) -> str:
    if compute not in COMPUTE_MODES:
        raise PosttrainError(f"unknown compute mode {compute!r} (choose from {', '.join(COMPUTE_MODES)})")
    return compute


class _FrozenQuantizedMatmul(torch.autograd.Function):
    """Forward through any kernel; backward d(x W^T)/dx = grad W with W dequantized again (straight-through
    for W8A8's activation rounding). Nothing but a reference to the layer is saved."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, layer: QuantizedLinear, kernel: Kernel) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return kernel.matmul(layer, x2d)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        weight = ctx.layer.dequantize(grad_out.dtype)  # (N, K)
        return grad_out @ weight, None, None


# ---- kernels ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    name: str
    supports: Callable[[QuantizedLinear, torch.Tensor], bool]
    matmul: Callable[[QuantizedLinear, torch.Tensor], torch.Tensor]  # (layer, x (M, K)) -> (M, N), no bias


def _aligned(t: torch.Tensor) -> bool:
    """torch 2.13's `_weight_int8pack_mm` segfaults on operands that are not 64-byte aligned (from 16 rows
    up): fresh allocations are aligned, views into safetensors buffers or at an offset need not be."""
    return t.data_ptr() % 64 == 0


def _cached(layer: QuantizedLinear, key: tuple, build: Callable[[], object]) -> object:
    if key not in layer._kernel_cache:
        layer._kernel_cache[key] = build()
    return layer._kernel_cache[key]


def _reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    if layer.scheme.activation_bits is not None:  # W8A8 in float: rounded activations times rounded weights
        return F.linear(fake_quantize_activations(x.float(), layer.scheme), layer.dequantize(torch.float32)).to(x.dtype)
    return F.linear(x, layer.dequantize(x.dtype))


@functools.cache
def cpu_int4_layout_matches() -> bool:
    """Whether torch's CPU int4 kernel reads our `tiles64` layout (checked once against torch's own packer)."""
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (2 * TILE_ROWS, 64), generator=gen, dtype=torch.int32)
    try:
        theirs = op(codes + 8, 2)
    except RuntimeError:
        return False
    return bool(torch.equal(theirs.reshape(-1), pack_int4(codes).reshape(-1)))


def _cpu_int4_group(layer: QuantizedLinear) -> int | None:
    """The kernel's group size: one of 32..256 dividing both our group size and K (a 128-group over
    K = 576 runs as 64-groups with each scale repeated, the last group of 64 once)."""
    K = layer.in_features
    group = layer.scheme.effective_group_size(K)
    return next((g for g in (256, 128, 64, 32) if group % g == 0 and K % g == 0), None)


def _cpu_int4_supports(layer: QuantizedLinear, x: torch.Tensor) -> bool:
    return (
        layer.scheme.bits == 4
        and x.device.type == "cpu"
        and layer.in_features % 2 == 0
        and _cpu_int4_group(layer) is not None
        and _aligned(layer.qweight)
        and cpu_int4_layout_matches()
    )


def _cpu_int4_scales_and_zeros(layer: QuantizedLinear) -> torch.Tensor:
    """(K / kernel_group, N_padded, 2) bf16: [scale, zero] per kernel group and output row."""
    K, N = layer.in_features, layer.out_features
    kernel_group = _cpu_int4_group(layer)
    repeat = layer.scheme.effective_group_size(K) // kernel_group
    n_groups = K // kernel_group
    scales = layer.scales.float().repeat_interleave(repeat, dim=1)[:, :n_groups]  # (N, K / kernel_group)
    zeros = (
        torch.zeros_like(scales)
        if layer.zeros is None
        else layer.zeros.float().repeat_interleave(repeat, dim=1)[:, :n_groups]
    )
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # (K / kg, N, 2)
    padded = layer.qweight.shape[0] * TILE_ROWS
    sz = F.pad(sz, (0, 0, 0, padded - N))  # padded rows: scale 0
    return sz.to(torch.bfloat16).contiguous()


def _cpu_int4_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    sz = _cached(layer, ("cpu_int4", x.device), lambda: _cpu_int4_scales_and_zeros(layer))
    T, K, _ = layer.qweight.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), layer.qweight.view(T * TILE_ROWS, K // 2), _cpu_int4_group(layer), sz
    )  # (M, N_padded) bf16
    if y.shape[1] != layer.out_features:
        y = y[:, : layer.out_features]
    return y.to(x.dtype)


def _native_input(x: torch.Tensor) -> bool:
    """Whether posttrain's int8 C kernels take this input: fp32 rows on CPU, with the kernels built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and kernels.library() is not None


def _native_decode_input(x: torch.Tensor) -> bool:
    """The same for int8_linear.c, at decode sizes (at most NATIVE_MAX_ROWS rows)."""
    return x.shape[0] <= NATIVE_MAX_ROWS and _native_input(x)


def _cpu_int8_native_supports(layer: QuantizedLinear, x: torch.Tensor) -> bool:
    scheme = layer.scheme
    if not (scheme.bits == 8 and scheme.symmetric and scheme.activation_bits is None and _native_decode_input(x)):
        return False
    if scheme.group_size is not None:  # torch has no grouped int8 kernel: this one on every CPU
        return scheme.group_size % 8 == 0 or scheme.group_size >= layer.in_features
    return not hardware.cpu_features().fast_bf16


def _cpu_int8_native_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return kernels.int8_linear(x, layer.qweight, _native_scales(layer), layer.scheme.group_size)  # (M, N)


def _native_scales(layer: QuantizedLinear) -> torch.Tensor:
    return _cached(layer, ("cpu_int8_native", "cpu"), lambda: layer.scales.float().contiguous())  # (N, G) fp32


def _cpu_q8_native_supports(layer: QuantizedLinear, x: torch.Tensor) -> bool:
    scheme = layer.scheme
    return (
        scheme.bits == 8
        and scheme.activation_bits == 8
        and scheme.group_size == kernels.Q8_GROUP
        and layer.in_features % kernels.Q8_GROUP == 0
        and _native_input(x)  # any rows: past decode sizes too it beats dequantizing (docs/quant.md)
    )


def _cpu_q8_native_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return kernels.q8_linear(x, layer.qweight, _native_scales(layer))  # (M, N)


@dataclass(frozen=True)
class NativeInt8Operands:
    """What posttrain's int8 kernels compute `layer(x)` from (posttrain/engine/native_decode.py calls them itself)."""

    codes: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N, G) fp32
    group: int  # codes per scale along a row (K: one per row)
    quantize_input: bool  # q8_linear.c (activations rounded to int8 by 32), else int8_linear.c (fp32 activations)


def native_int8_operands(layer: QuantizedLinear, x: torch.Tensor) -> NativeInt8Operands | None:
    """The operands where `forward` would take one of posttrain's int8 kernels for an input like x (M, K); else
    None."""
    kernel = layer.kernel_for(x)
    if kernel not in (KERNELS["cpu_int8_native"], KERNELS["cpu_q8_native"]):
        return None
    group = layer.scheme.group_size or layer.in_features
    return NativeInt8Operands(layer.qweight, _native_scales(layer), group, kernel is KERNELS["cpu_q8_native"])


def _cpu_int8_supports(layer: QuantizedLinear, x: torch.Tensor) -> bool:
    return (
        layer.scheme.bits == 8
        and layer.scheme.group_size is None  # one scale per output channel
        and layer.scheme.activation_bits is None
        and x.device.type == "cpu"
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        and _aligned(layer.qweight)
    )


def _cpu_int8_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    scales = _cached(layer, ("cpu_int8", x.device), lambda: layer.scales[:, 0].to(torch.bfloat16).contiguous())
    x16 = x.to(torch.bfloat16)
    if not (x16.is_contiguous() and _aligned(x16)):
        x16 = x16.clone(memory_format=torch.contiguous_format)
    y = torch.ops.aten._weight_int8pack_mm(x16, layer.qweight, scales).to(x.dtype)  # (M, N)
    if layer.zeros is not None:  # w = q s + z: the zero point adds z_n * sum_k x_k to output n
        y = y + (x.float().sum(dim=-1, keepdim=True) * layer.zeros[:, 0]).to(x.dtype)
    return y


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether torch's CPU `_int_mm` sums int8 x int8 products exactly here (checked once, on codes that pair
    +127 * +127 products). Without VNNI, oneDNN's int8 GEMM adds pairs of products in int16 and saturates (measured
    off by up to 9e4 over 576 terms with oneDNN capped at AVX2): W8A8 then takes the reference kernel."""
    if not hasattr(torch, "_int_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (256, 64), generator=gen, dtype=torch.int8)
    a[:, :16], b[:16, :] = 127, 127  # the sums that overflow int16 first
    try:
        got = torch._int_mm(a, b)
    except RuntimeError:
        return False
    return bool(torch.equal(got.long(), a.long() @ b.long()))


def _int_mm_supports(layer: QuantizedLinear, x: torch.Tensor) -> bool:
    # Verified on CPU only; CUDA's _int_mm has shape limits (more than 16 rows, multiples of 8) left untested.
    per_token = layer.scheme.activation_bits == 8 and layer.scheme.group_size is None
    return per_token and x.device.type == "cpu" and int_mm_is_exact()


def _int_mm_matmul(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    codes, x_scales = quantize_per_token(x)  # (M, K) int8, (M, 1)
    acc = torch._int_mm(codes, layer.qweight.t())  # (M, N) int32, exact
    return (acc.float() * x_scales * layer.scales[:, 0]).to(x.dtype)


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("cpu_int4_bf16", _cpu_int4_supports, _cpu_int4_matmul),
        Kernel("cpu_int8_native", _cpu_int8_native_supports, _cpu_int8_native_matmul),
        Kernel("cpu_q8_native", _cpu_q8_native_supports, _cpu_q8_native_matmul),
        Kernel("cpu_int8_bf16", _cpu_int8_supports, _cpu_int8_matmul),
        Kernel("int_mm", _int_mm_supports, _int_mm_matmul),
        Kernel("reference", lambda layer, x: True, _reference),
    )
}
KERNEL_ORDER = tuple(KERNELS)  # "auto": the first that supports the input; `reference` always does


# ---- whole models ---------------------------------------------------------------------------------------


def decoder_linear_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if DECODER_LINEAR.fullmatch(name)]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model: nn.Module, scheme: str | QuantScheme, compute: str = "auto") -> nn.Module:
    """Replace every decoder linear (attention q/k/v/o, MLP gate/up/down) with a QuantizedLinear, in place.

    lm_head and the embeddings stay in their float dtype: in the default model lm_head is the embedding
    (tied), so quantizing it would add a copy rather than save memory, and its error lands on every logit.
    Quantize before applying LoRA (QLoRA wraps the quantized layers).
    """
    scheme = get_scheme(scheme)
    check_compute(compute)
    names = decoder_linear_names(model)
    if not names:
        raise PosttrainError("quantize_model: the model has no decoder linear layers (layers.N.self_attn.q_proj ...)")
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, QuantizedLinear):
            raise PosttrainError(f"quantize_model: {name} is already quantized ({module.scheme.name})")
        if type(module) is not nn.Linear:
            raise PosttrainError(
                f"quantize_model: {name} is a {type(module).__name__}, not nn.Linear "
                "(quantize before applying LoRA or QAT)"
            )
        replace_module(model, name, QuantizedLinear.from_linear(module, scheme, compute, source=name))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "extra"):
        config.extra["quantization_config"] = scheme.to_config()  # a saved config.json then says what it holds
    return model


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace every QuantizedLinear with an nn.Linear holding its dequantized weight, in place (for export,
    or to trade memory for fp32 speed)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = nn.Linear(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                device=module.qweight.device,
                dtype=dtype,
            )
            with torch.no_grad():
                linear.weight.copy_(module.dequantize(dtype))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            replace_module(model, name, linear)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "extra"):
        config.extra.pop("quantization_config", None)
    return model


def set_compute(model: nn.Module, compute: str) -> nn.Module:
    """Set `compute` ("auto" | "reference") on every QuantizedLinear of the model."""
    check_compute(compute)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.compute = compute
    return model

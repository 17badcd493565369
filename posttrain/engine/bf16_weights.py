"""The engine's compute dtype, and the bf16 copies of the linear weights it computes with over fp32 master weights.

Why: on a CPU with fast bf16 (AVX512-BF16, AMX) a bf16 matmul runs ~4x an fp32 one, and a decode step streams
every weight once, so half the bytes is half the memory traffic too. The trainer's module stays fp32 (its
optimizer steps it, the engine shares it); the engine computes its linear layers from bf16 copies.

`resolve_compute_dtype` turns EngineConfig.compute_dtype into a torch dtype: `auto` is bf16 only over fp32 weights
on a CPU that `posttrain.hardware` finds fast in bf16, else the weights' own dtype (so an AVX2 CPU keeps the fp32
path bit for bit); `float32` / `bfloat16` ask for one, and only bf16 over fp32 weights (CPU only) differs from the
weights'.

`Bf16Weights.scope()` is a TorchFunctionMode around the runner's forward, like packed_weights.py's: every
`F.linear` over an fp32 weight (nn.Linear, LoRA's base and adapter layers, the LM head) runs as x in bf16 times
the weight's bf16 copy, accumulated in fp32, and hands back fp32: with the native kernels through bf16_linear.c
over a packed copy (1.3-4x oneDNN's GEMM at the engine's sizes), else oneDNN's bf16 GEMM over a row-major one. So everything between the linear layers stays fp32 (the residual stream, RMSNorm, RoPE, the attention's
softmax, SwiGLU's product; the fused C kernels of posttrain.kernels run unchanged), the LM head's bf16 logits come
back as fp32 and the log-softmax runs in fp32. A bias is added in fp32 after the product.

A copy remembers its weight's version counter (bumped by every in-place write, e.g. an optimizer step) and data
pointer (a loader assigning new storage), and is remade when either moves; `clear()` (the engine calls it on
weights_updated() and sleep()) drops them all. Memory: half the fp32 bytes of every linear weight the forward
meets (270 MB for SmolLM2-135M, whose tied embedding is copied once, for its LM head).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from posttrain import kernels
from posttrain.engine.linear_mode import LinearMode
from posttrain.errors import PosttrainError
from posttrain.hardware import auto_dtype

logger = logging.getLogger("posttrain.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # EngineConfig.compute_dtype but auto


def resolve_compute_dtype(setting: str, weights_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the engine computes in for EngineConfig.compute_dtype=`setting` (module docstring)."""
    if setting == "auto":
        if device.type != "cpu" or weights_dtype != torch.float32:
            return weights_dtype
        choice = auto_dtype("cpu")
        if choice.dtype != "bfloat16":
            return torch.float32
        logger.info(
            "posttrain: the engine computes in bf16 over the fp32 weights (compute_dtype=auto: %s)", choice.reason
        )
        return torch.bfloat16
    wanted = TORCH_DTYPES[setting]
    if wanted == weights_dtype:
        return wanted
    if wanted == torch.bfloat16 and weights_dtype == torch.float32:
        if device.type != "cpu":  # the attention backends of accelerators take bf16 queries: load bf16 weights there
            raise PosttrainError(
                f"compute_dtype='bfloat16' over float32 weights runs on CPU only; on {device.type} load the model "
                "in bfloat16 (dtype='bfloat16', the default there)"
            )
        return wanted
    raise PosttrainError(
        f"compute_dtype={setting!r}: the model's weights are {str(weights_dtype).removeprefix('torch.')}; the engine "
        "computes in the weights' dtype, or in bfloat16 over float32 weights"
    )


@dataclass
class _Copy:
    weight: weakref.ref  # the weight the copy is of (an id alone could be reused by a new tensor)
    version: int  # the weight's version counter and data pointer when `copy` was made
    data_ptr: int
    copy: torch.Tensor  # (N, K) bf16


class Bf16Weights:
    """bf16 copies of the fp32 weights that F.linear meets inside `scope()`, keyed by the weight tensor."""

    def __init__(self, packed: bool = False) -> None:
        """`packed`: copies in bf16_linear.c's packed layout and every product through that kernel (the native
        kernels' bf16 GEMM, 1.3-4x oneDNN's at the engine's sizes, and what the native decode step reads); else
        row-major copies and oneDNN's GEMM. The two differ in the order of each fp32 sum only, before the output's
        rounding to bf16."""
        self._copies: dict[int, _Copy] = {}
        self.packed = packed
        self.num_copies_made = 0  # copies made so far, the remade ones included (tests and stats)

    def clear(self) -> None:
        self._copies.clear()

    @property
    def num_held(self) -> int:
        return len(self._copies)

    @property
    def bytes_held(self) -> int:
        return sum(entry.copy.numel() * entry.copy.element_size() for entry in self._copies.values())

    def scope(self) -> TorchFunctionMode:
        return LinearMode(self.linear)

    def copy_of(self, weight: torch.Tensor) -> torch.Tensor:
        """The current bf16 copy of `weight` (made, or remade when the weight changed since). A weight made inside
        the forward (an inference tensor: a quantized layer's dequantized weight) has no version to watch and
        lives for one call: its copy is made for that call and not kept."""
        if weight.is_inference():
            return self._copy(weight)
        entry = self._copies.get(id(weight))
        if (
            entry is not None
            and entry.weight() is weight
            and entry.version == weight._version
            and entry.data_ptr == weight.data_ptr()
        ):
            return entry.copy
        copy = self._copy(weight)
        self._copies[id(weight)] = _Copy(weakref.ref(weight), weight._version, weight.data_ptr(), copy)
        self.num_copies_made += 1
        return copy

    def _copy(self, weight: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return kernels.bf16_pack(weight)  # (ceil(N / 64), ceil(K / 2), 64, 2)
        return weight.detach().to(torch.bfloat16, memory_format=torch.contiguous_format)  # (N, K)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """F.linear(x, weight, bias) in bf16 with an fp32 result, or None where this call does not qualify."""
        if not _qualifies(x, weight):
            return None
        fp32_bias = None
        if self.packed:
            rows, out_features = x.numel() // x.shape[-1], weight.shape[0]
            fp32_bias = bias if bias is not None and bias.dtype == torch.float32 else None  # added by the kernel
            out = kernels.bf16_linear(x.reshape(rows, x.shape[-1]), self.copy_of(weight), out_features, fp32_bias)
            out = out.view(*x.shape[:-1], out_features)
        else:
            out = F.linear(x.to(torch.bfloat16), self.copy_of(weight)).float()  # (..., N)
        return out if bias is None or bias is fp32_bias else out.add_(bias)


def _qualifies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 operands without autograd, and a plain 2-D weight (subclasses - quantized, DTensor - keep their op)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2 or x.requires_grad:
        return False
    if weight.requires_grad and torch.is_grad_enabled():
        return False
    return type(weight) in (torch.Tensor, torch.nn.Parameter)

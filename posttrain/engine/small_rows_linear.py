"""F.linear for a few input rows (batch-1 and small-batch decode) through posttrain's multi-threaded kernel.

Why: with at most MAX_ROWS input rows a linear layer is bound by its weight's bytes through memory, and MKL's
sgemm runs it on one thread. posttrain/kernels/f32_linear.c splits the output rows over torch's threads, so every
core streams its share: 60 SmolLM2-sized weights from memory on a 2-core AVX2 machine went through at
16.9 GB/s against MKL's 6.8-10.7 at M = 1, 13.8 against 5.9 at M = 4, 10.0 against 5.2 at M = 8, and even at
M = 16 (where this route stops). The result is F.linear's within fp32 rounding (another summation order), and
each output row's value depends only on its own input row, whatever else shares the call.

The runner enters it (with the MKL-packed weights for larger M, packed_weights.py) around its fp32 CPU forward
when the native kernels are on (EngineConfig.cpu_kernels, POSTTRAIN_CPU_KERNELS).
"""

from __future__ import annotations

import torch

from posttrain import kernels
from posttrain.engine.packed_weights import fp32_cpu_operands

MAX_ROWS = 8  # from 16 rows on, MKL's sgemm is as fast (see above)


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) by the native kernel, or None where this call does not qualify."""
    if not fp32_cpu_operands(x, weight, bias):
        return None
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or rows == 0:
        return None
    out = kernels.f32_linear(x.reshape(rows, x.shape[-1]), weight, bias)  # (M, N)
    return out.view(*x.shape[:-1], weight.shape[0])

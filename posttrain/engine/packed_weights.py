"""MKL-packed copies of the model's linear weights, for the engine's CPU forward passes.

Why: in a rollout's decode step every weight meets the same M rows (one per running sequence, 512 in
`benchmarks/rollout.py`) exactly once, and MKL's sgemm first copies the weight into its panel layout, on
every call. perf put those copies (`sgemm_scopy_*`) at about a fifth of the engine's matmul time. MKL can
keep a weight packed for a given M (`cblas_sgemm_pack`, reached through `torch.ops.mkl`): then each call
only computes. Same-shape microbenchmark, 2 threads: 1.14-1.33x per matmul for M = 64-512; under 64 rows it
gains nothing (below 16 MKL takes other kernels, whose results also differ in the last bits).

How: `PackedWeights.scope()` is a TorchFunctionMode around the runner's forward. It sees every
`F.linear` call (nn.Linear, LoRA's base layers, the LM head). A weight is packed the second time in a row
that it meets the same M, so a one-off prefill chunk does not pay for a pack; after that each call with that
M uses the packed copy. The packed result is MKL's sgemm on the same operands: bit for bit F.linear's at most
shapes, and where MKL splits a long inner dimension differently (K = 1536, SmolLM2's down projection, at some
M) within float rounding (~4e-7 relative); the tests check both.

Weights change under a live engine: the trainer's optimizer steps them in place, or a loader assigns new
storage. A packed copy remembers the weight's version counter (bumped by every in-place write) and data
pointer, and is rebuilt when either moves, so the engine always computes with the current weights.
`clear()` (the engine calls it on weights_updated() and sleep()) drops every copy.

Cost: one more copy of every packed weight (540 MB for SmolLM2-135M in fp32) while packed; EngineConfig's
`pack_cpu_weights=False` turns it off.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from posttrain.engine.linear_mode import LinearMode

MIN_ROWS = 64  # fewer rows per call: MKL's unpacked path is as fast (see above)


def available() -> bool:
    """Whether this PyTorch build has MKL's packed sgemm."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


@dataclass
class _Entry:
    weight: weakref.ref  # the weight the entry is about (an id alone could be reused by a new tensor)
    rows: int  # M of the weight's last call
    version: int  # the weight's version counter and data pointer when `packed` was made
    data_ptr: int
    packed: torch.Tensor | None  # MKL's packed copy for `rows`, or None before the second same-M call


class PackedWeights:
    """Packed copies of the weights that F.linear meets inside `scope()`, keyed by the weight tensor."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self.num_packs = 0  # packs made so far (tests and stats)

    def clear(self) -> None:
        self._entries.clear()

    @property
    def num_packed(self) -> int:
        return sum(entry.packed is not None for entry in self._entries.values())

    def scope(self) -> TorchFunctionMode:
        return LinearMode(self.linear)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """F.linear(x, weight, bias) through a packed weight, or None where this call does not qualify."""
        if not fp32_cpu_operands(x, weight, bias):
            return None
        rows = x.numel() // x.shape[-1]
        if rows < MIN_ROWS:
            return None
        entry = self._entries.get(id(weight))
        if entry is None or entry.weight() is not weight:
            self._entries[id(weight)] = _Entry(weakref.ref(weight), rows, -1, 0, None)
            return None
        current = (
            entry.packed is not None
            and entry.rows == rows
            and entry.version == weight._version
            and entry.data_ptr == weight.data_ptr()
        )
        if not current:
            if entry.rows != rows:  # a new M: pack only if the next call brings the same M again
                entry.rows, entry.packed = rows, None
                return None
            entry.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            entry.version, entry.data_ptr = weight._version, weight.data_ptr()
            self.num_packs += 1
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), entry.packed, weight, bias, rows)  # (M, N)
        return out.view(*x.shape[:-1], weight.shape[0])


def fp32_cpu_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """fp32 CPU operands without autograd, a contiguous 2-D weight and a 1-D bias or none."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 2 or x.requires_grad:
        return False
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or not weight.is_contiguous()
        or weight.requires_grad
        and torch.is_grad_enabled()
    ):
        return False
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):  # subclasses (quantized, DTensor) keep their op
        return False
    return bias is None or (bias.dtype == torch.float32 and bias.dim() == 1 and bias.device.type == "cpu")

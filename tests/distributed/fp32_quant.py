"""`python -m tests.distributed.fp32_quant <posttrain arguments>`: the posttrain CLI with every quantized linear
computed by the fp32 reference kernel (dequantize, then F.linear), for the QLoRA runs compared across processes.

On CPU, `auto` picks torch's weight-only int8 / int4 kernels, which round the activations to bf16 (8 bits of
mantissa). An activation that two processes compute in another summation order, ~1e-7 apart, then lands on
another bf16 value whenever it sits that close to a rounding boundary: a step of 2^-8 of it, which AdamW and the
next rollout's sampling carry on. What such a run can promise is bf16's precision, too coarse to tell a sharded
run's bug from rounding; the reference kernel computes the scheme's exact semantics in fp32, so the comparison
stays about the sharding (tests/numeric.py). The bf16 kernels are held to that reference in tests/quant.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from posttrain.quant import linear


@contextmanager
def reference_kernel() -> Iterator[None]:
    """Within it (in this process), every QuantizedLinear computes through the reference kernel."""
    order = linear.KERNEL_ORDER
    linear.KERNEL_ORDER = ("reference",)
    try:
        yield
    finally:
        linear.KERNEL_ORDER = order


if __name__ == "__main__":
    from posttrain.cli import program

    with reference_kernel():
        program(sys.argv[1:])  # exits: a torchrun rank without the runtime's teardown (posttrain.cli.program)

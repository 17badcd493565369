"""The native CPU kernels built for each instruction set the suite checks (the `kernel_march` fixture).

The kernels are compiled for this CPU (`-march=native`: AVX-512 on the machines that have it), and the compiler
vectorises their loops differently for another instruction set, so their sums come out in another order: a
machine with AVX-512 also builds and checks the x86-64-v3 (AVX2 + FMA) library, the one an AVX2-only machine
builds natively. Another machine skips what its CPU cannot run (an AVX2 machine the AVX-512 build, as it must).
"""

from __future__ import annotations

import pytest

from posttrain import kernels

KERNEL_MARCHES = ["native", "x86-64-v3"]  # posttrain.kernels.MARCH_ENV values


def use_kernels_built_for(march: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on (until the test's end and `forget_kernels`), `kernels.library()` is the build for `march`;
    skips the test where this CPU cannot run it or the compiler cannot build it."""
    if kernels.runs_here(march) is not True:
        pytest.skip(f"this CPU does not run {march} code")
    monkeypatch.setenv(kernels.MARCH_ENV, march)
    kernels.library.cache_clear()
    if kernels.library() is None:
        pytest.skip(f"the kernels do not build for {march} here (no C compiler with OpenMP, or no such target)")


def forget_kernels() -> None:
    kernels.library.cache_clear()  # the next call loads the build the environment names again

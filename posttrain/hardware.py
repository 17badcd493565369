"""What this CPU computes fast: bf16 and int8 dot-product instructions, and measured matmul rates per dtype.

The features come from /proc/cpuinfo's flags (x86 Linux):
- fast bf16: `avx512_bf16` (AVX512-BF16's dot products) or `amx_bf16` (AMX tiles). Without either, PyTorch
  emulates bf16 matmuls through fp32 conversions, hundreds of times slower than fp32 (AVX2 machines).
- int8 dot products: `avx512_vnni`, `avx_vnni` or `amx_int8`.

`POSTTRAIN_CPU_FEATURES` replaces the flags read from the CPU, for tests and for a user who knows better: a list
of flag names separated by commas or spaces, e.g. `avx2` (an AVX2-only CPU) or `avx512f,avx512_bf16,avx512_vnni`
(a Zen 4/5). A forced feature set is believed as given: `auto` then skips the rate check below.

`matmul_rates()` times a small square matmul per dtype (a fraction of a second, the emulated bf16 of an AVX2 CPU
included; the dtypes take turns over a few rounds and each keeps its best) and caches the result under the
posttrain cache, keyed by the CPU's model and flags, the torch version and the thread count, as the kernels are.
A result that contradicts the flags (fast bf16 flags, bf16 no faster than fp32) is not cached: a probe taken while
other work held the cores would otherwise pin `auto` to fp32 on this machine for good (measured: 4.2 against 73
GFLOP/s during a compile on a Zen 5 whose quiet bf16 is ~4x fp32), so it is measured again next time.

`auto_dtype(device)` is what `dtype: auto` computes in: bf16 on an accelerator; on a CPU bf16 only where the CPU
has fast bf16 AND its measured bf16 matmul beats fp32 (so `auto` never silently makes a run slower), else fp32.

A leaf: it imports nothing of ours but the cache location, and torch only inside the functions that time or ask it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from posttrain.cache import cache_root

FEATURES_ENV = "POSTTRAIN_CPU_FEATURES"
FAST_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
# The flags `posttrain info` lists (the rest of /proc/cpuinfo's are not about matmul speed).
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni")
SHOWN_FLAGS += ("amx_tile", "amx_bf16", "amx_int8")
PROBE_SIZE = 256  # (n, n) @ (n, n): big enough to leave the call overhead behind, small enough for emulated bf16
PROBE_SECONDS = 0.05  # per dtype and round, after one warm-up call
PROBE_ROUNDS = 3  # the dtypes take turns; each keeps its best round, so a burst of other work hits one round only
PROBE_VERSION = 2  # bump when the probe changes, so cached rates of the old one are not read


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's model name and feature flags (or the forced ones)."""

    model: str
    flags: frozenset[str]
    forced: bool  # the flags come from POSTTRAIN_CPU_FEATURES

    @property
    def fast_bf16(self) -> bool:
        return fast_bf16_flags(self.flags)

    @property
    def int8_dot(self) -> bool:
        return bool(self.flags & INT8_DOT_FLAGS)

    def shown_flags(self) -> list[str]:
        return [flag for flag in SHOWN_FLAGS if flag in self.flags]


def fast_bf16_flags(flags: frozenset[str]) -> bool:
    return bool(flags & FAST_BF16_FLAGS)


def cpu_features() -> CpuFeatures:
    """This CPU's features; POSTTRAIN_CPU_FEATURES (read on every call, so tests can set it) replaces the flags."""
    model, flags = _cpuinfo()
    forced = os.environ.get(FEATURES_ENV, "").strip()
    if forced:
        return CpuFeatures(model, frozenset(forced.replace(",", " ").lower().split()), True)
    return CpuFeatures(model, flags, False)


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", {}) where there is none."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key in ("flags", "Features"):  # x86, arm64
            flags = frozenset(value.split())
        elif not line.strip():  # the first processor is enough
            break
    return model, flags


def torch_capability() -> str:
    """ATen's vectorised CPU kernels in use ("AVX512", "AVX2", "DEFAULT", ...; ATEN_CPU_CAPABILITY lowers it)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def matmul_rates() -> dict[str, float]:
    """GFLOP/s of a (256, 256) @ (256, 256) matmul in float32, bfloat16 and int8 (torch._int_mm, where it runs),
    on torch's current threads; measured once per CPU, torch version and thread count, then read from the cache."""
    import torch

    model, flags = _cpuinfo()
    identity = [model, " ".join(sorted(flags)), torch.__version__, str(torch.get_num_threads()), str(PROBE_VERSION)]
    key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]
    path = cache_root() / "hardware" / f"matmul-{key}.json"
    try:
        return {name: float(rate) for name, rate in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        pass
    rates = _measure()
    if fast_bf16_flags(flags) and rates["bfloat16"] <= rates["float32"]:
        return rates  # suspect (see the module docstring): believed for this process only
    try:  # write beside and rename: two processes probing at once never read half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(rates))
        os.replace(partial, path)
    except OSError:  # an unwritable cache only costs the probe again next time
        pass
    return rates


def _measure() -> dict[str, float]:
    import torch

    n = PROBE_SIZE
    flops = 2.0 * n**3
    generator = torch.Generator().manual_seed(0)
    calls = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(n, n, generator=generator).to(dtype)
        b = torch.randn(n, n, generator=generator).to(dtype)
        calls[name] = lambda a=a, b=b: torch.mm(a, b)
    a8 = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=generator)
    b8 = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=generator)
    calls["int8"] = lambda: torch._int_mm(a8, b8)
    rates: dict[str, float] = {}
    for _ in range(PROBE_ROUNDS):
        for name, call in list(calls.items()):
            try:
                rate = _rate(call, flops)
            except (RuntimeError, AttributeError, NotImplementedError):  # no CPU int8 matmul in this torch
                del calls[name]
                continue
            rates[name] = max(rates.get(name, 0.0), rate)
    return rates


def _rate(call: object, flops: float) -> float:
    """GFLOP/s of `call()`: one warm-up, then calls until PROBE_SECONDS have passed (at least one)."""
    call()  # type: ignore[operator]
    calls, start = 0, time.perf_counter()
    while True:
        call()  # type: ignore[operator]
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= PROBE_SECONDS:
            return round(flops * calls / elapsed / 1e9, 3)


@dataclass(frozen=True)
class DtypeChoice:
    """What `dtype: auto` computes in, and why."""

    dtype: str  # "float32" | "bfloat16"
    reason: str


def auto_dtype(device_type: str = "cpu") -> DtypeChoice:
    """The compute dtype `auto` picks on a `device_type` ("cpu", "cuda", ...) device (see the module docstring)."""
    if device_type != "cpu":
        return DtypeChoice("bfloat16", f"bf16 on {device_type}")
    features = cpu_features()
    source = f"{FEATURES_ENV}={os.environ.get(FEATURES_ENV, '').strip()}" if features.forced else "this CPU"
    if not features.fast_bf16:
        return DtypeChoice("float32", f"{source} has no fast bf16 (avx512_bf16 / amx_bf16): fp32 is the fast path")
    if features.forced:
        return DtypeChoice("bfloat16", f"{source} has fast bf16 (forced; the rates are not checked)")
    rates = matmul_rates()
    bf16, fp32 = rates["bfloat16"], rates["float32"]
    if bf16 <= fp32:
        return DtypeChoice(
            "float32",
            f"this CPU has fast bf16 flags, but its bf16 matmul measured {bf16} GFLOP/s against fp32's {fp32}",
        )
    return DtypeChoice("bfloat16", f"this CPU has fast bf16: bf16 matmul {bf16 / fp32:.1f}x fp32 ({bf16} GFLOP/s)")


def report() -> dict[str, object]:
    """What `posttrain info` shows about the CPU: features, measured rates, and what `auto` picks and why."""
    features = cpu_features()
    choice = auto_dtype("cpu")
    return {
        "model": features.model,
        "flags": features.shown_flags(),
        "flags_forced": features.forced,
        "fast_bf16": features.fast_bf16,
        "int8_dot": features.int8_dot,
        "torch_capability": torch_capability(),
        "matmul_gflops": matmul_rates(),
        "auto_dtype": choice.dtype,
        "auto_dtype_reason": choice.reason,
    }

"""The engine's native CPU kernels, built with the system's C compiler on first use: the paged decode
attention and K/V writes (paged_decode.c), the decoder layer's fused elementwise ops (decoder_ops.c,
used through `fused`), and the plain draw of the sampler (sampler.c).

`library()` compiles the sources once per source, compiler and CPU into the cache directory
($POSTTRAIN_CACHE/kernels, else ~/.cache/posttrain/kernels), loads it with ctypes and returns it; None when
that cannot be done (no compiler, no OpenMP, an unwritable cache, a failed build: logged once, with the
compiler's message), or when POSTTRAIN_CPU_KERNELS=0. The callers then take the pure-PyTorch path, which
computes the same attention more slowly.

The build uses OpenMP and `-march=native`, or the target POSTTRAIN_CPU_KERNELS_MARCH names (a GCC -march value,
e.g. x86-64-v3: AVX2 and FMA; x86-64-v4: AVX-512), which the tests use to check the AVX2 build on an AVX-512 CPU.
The shared object needs libgomp.so.1, the soname PyTorch's own OpenMP runtime has on Linux, so the kernels run on
the threads of torch's intra-op pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from posttrain.cache import cache_root

logger = logging.getLogger("posttrain.kernels")

HERE = Path(__file__).parent
SOURCES = [
    HERE / "paged_decode.c",
    HERE / "decoder_ops.c",
    HERE / "sampler.c",
    HERE / "int8_linear.c",
    HERE / "q8_linear.c",
    HERE / "f32_linear.c",
    HERE / "bf16_linear.c",
    HERE / "decode_step.c",
]
HEADERS = [HERE / "vec_math.h", HERE / "paged_decode_kv.h", HERE / "attention_rows.h", HERE / "linear_outputs.h"]
DISABLE_ENV = "POSTTRAIN_CPU_KERNELS"  # "0": never build or use them
MARCH_ENV = "POSTTRAIN_CPU_KERNELS_MARCH"  # the instruction set to build for; unset: the CPU's own ("native")
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]  # + -march=<target_march()>
LANES = 8  # head_dim must be a multiple of the kernel's vector width
Q8_GROUP = 32  # q8_linear.c's group: activations and weights share a scale per 32 along K
# What the psABI's x86-64 levels need of the CPU, in /proc/cpuinfo's names: code built for a level the CPU lacks
# dies of SIGILL on its first call, so `library` refuses such a build instead.
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_LEVELS = {
    "x86-64-v2": _V2,
    "x86-64-v3": _V3,
    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_DECODE_ATTENTION = [
    _ptr,
    _ptr,
    _ptr,
    _i64,
    _i64,
    _i64,
    _i64,
    _i64,
    _ptr,
    _i64,
    _ptr,
    _ptr,
    _ptr,
    _ptr,
    _i64,
    _i64,
    _f32,
    _int,
]
SIGNATURES = {  # the argument types of each function the library exports
    "paged_decode_attention": _DECODE_ATTENTION,  # over an fp32 pool
    "paged_decode_attention_bf16": _DECODE_ATTENTION,  # over a bf16 pool
    "paged_write_kv": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "rms_norm": [_ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    "add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    "rotary": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "silu_mul": [_ptr, _ptr, _ptr, _i64, _int],
    "sample_rows": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int],
    "int8_linear": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "q8_linear": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "f32_linear": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "bf16_linear": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int],
    "round_to_bf16": [_ptr, _ptr, _i64],
    "bf16_pack": [_ptr, _ptr, _i64, _i64, _int],
    "decode_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int],
    # layers, num_layers, step, context_lens, head, embedding, final_norm, x, hidden, logits, tokens, logprobs,
    # temperatures, uniforms, sum_block, halt, num_halt, steps, scratch, threads
    "decode_chained_steps": [*[_ptr, _i64], *[_ptr] * 12, _i64, _ptr, _i64, _i64, _ptr, _int],
}
RESULTS = {"decode_chained_steps": _i64}  # the functions that return something (the steps they ran)


class KernelBuildError(RuntimeError):
    pass


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (see the module docstring)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    march = target_march()
    if runs_here(march) is False:
        logger.warning(
            "posttrain: %s=%s names an instruction set this CPU lacks; the native CPU kernels are not "
            "used (the engine runs them in PyTorch)",
            MARCH_ENV,
            march,
        )
        return None
    try:
        lib = ctypes.CDLL(str(_build(march)))
    except (KernelBuildError, OSError) as e:
        logger.warning(
            "posttrain: native CPU kernels unavailable, the engine's decode attention, elementwise ops "
            "and sampling run in PyTorch (slower): %s",
            e,
        )
        return None
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, RESULTS.get(name)
    return lib


def target_march() -> str:
    """The -march the kernels are built for: POSTTRAIN_CPU_KERNELS_MARCH, else "native" (this CPU's features)."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def runs_here(march: str) -> bool | None:
    """Whether this CPU runs code built for `march`: True for native, an x86-64 level checked against the CPU's
    flags, None where that cannot be told (another target, or no /proc/cpuinfo)."""
    if march == "native":
        return True
    if march not in X86_LEVELS or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = next(
        (line.split(":", 1)[1].split() for line in _cpu_identity().decode().splitlines() if line.startswith("flags")),
        None,
    )
    return None if flags is None else X86_LEVELS[march] <= set(flags)


def supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernels take this layer: fp32 queries on CPU, K/V heads in the (2, blocks, bs, Hkv, D) pool of
    fp32 or bf16 (the engine's compute_dtype=bfloat16)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.dim() == 5
        and cache.shape[0] == 2
        and cache.shape[-1] % LANES == 0
        and cache.is_contiguous()
        and library() is not None
    )


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """cache (2, num_blocks, bs, Hkv, D) gets k, v (N, Hkv, D) at the flat slots (N,); slots < 0 skipped. k, v are
    rounded to the pool's dtype first (round to nearest even, as every cast to bf16 in torch)."""
    k, v, slots = k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous(), slots.to(torch.int64).contiguous()
    num_slots = cache.shape[1] * cache.shape[2]
    library().paged_write_kv(
        cache.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        slots.data_ptr(),
        slots.numel(),
        num_slots,
        cache.shape[3] * cache.shape[4] * cache.element_size(),
        torch.get_num_threads(),
    )


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor,
    group_starts: torch.Tensor,
    group_shared: torch.Tensor,
    max_members: int,
) -> None:
    """Fill out[rows] with the attention of q[rows] over each sequence's context (paged_decode.c).

    q, out (N, H, D) contiguous fp32; the pool fp32 or bf16 (read as fp32, accumulated in fp32); tables (S, W),
    context_lens (S,), rows (S,) int64 for the S decoding sequences, in groups: [group_starts[g],
    group_starts[g + 1]) share their first group_shared[g] blocks; max_members the largest group."""
    _, num_blocks, bs, hkv, d = cache.shape
    H = q.shape[1]
    kernel = (
        library().paged_decode_attention_bf16 if cache.dtype == torch.bfloat16 else library().paged_decode_attention
    )
    kernel(
        q.data_ptr(),
        cache.data_ptr(),
        out.data_ptr(),
        num_blocks,
        bs,
        hkv,
        H // hkv,
        d,
        tables.data_ptr(),
        tables.shape[1],
        context_lens.data_ptr(),
        rows.data_ptr(),
        group_starts.data_ptr(),
        group_shared.data_ptr(),
        group_shared.numel(),
        max_members,
        d**-0.5,
        torch.get_num_threads(),
    )


def samples_on_cpu(logits: torch.Tensor) -> bool:
    """Whether `sample_rows` takes these (rows, vocab) logits: fp32 on CPU, with the kernels built."""
    return (
        logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and (library() is not None)
    )


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfiltered draw from softmax(logits) per row, one uniform each, and the drawn tokens' logprobs
    (sampler.c). logits (R, V) fp32, uniforms (R,) in [0, 1) -> token ids (R,) int64, logprobs (R,) fp32."""
    logits, uniforms = logits.contiguous(), uniforms.to(torch.float64).contiguous()
    rows, vocab_size = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    library().sample_rows(
        logits.data_ptr(),
        rows,
        vocab_size,
        block,
        uniforms.data_ptr(),
        tokens.data_ptr(),
        logprobs.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens, logprobs


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x (M, K) fp32 times int8 codes (N, K) -> (M, N) fp32 (int8_linear.c). scales: fp32 (N,) or (N, 1), one per
    row (group None), or (N, ceil(K / group)), one per `group` codes along a row (a multiple of 8)."""
    x, codes, scales = x.contiguous(), codes.contiguous(), scales.contiguous()
    M, K = x.shape
    N = codes.shape[0]
    if group is not None and group < K and group % 8:
        raise ValueError(f"int8_linear: group={group} must be a multiple of 8")
    y = torch.empty(M, N, dtype=torch.float32)
    library().int8_linear(
        x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), M, N, K, group or K, torch.get_num_threads()
    )
    return y


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32, rounded to int8 in groups of 32 along K, times int8 codes (N, K) with an fp32 scale per group
    of 32 (N, K / 32) -> (M, N) fp32 (q8_linear.c: llama.cpp's Q8_0 product; K a multiple of 32)."""
    x, codes, scales = x.contiguous(), codes.contiguous(), scales.contiguous()
    M, K = x.shape
    N = codes.shape[0]
    if K % Q8_GROUP:
        raise ValueError(f"q8_linear: K={K} must be a multiple of {Q8_GROUP}")
    y = torch.empty(M, N, dtype=torch.float32)
    library().q8_linear(
        x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), M, N, K, torch.get_num_threads()
    )
    return y


BF16_PACK_COLS = 64  # outputs per block of bf16_linear.c's packed layout


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight (N, K) rounded to bf16 (to nearest even, as torch's cast) in bf16_linear.c's packed layout:
    (ceil(N / 64), ceil(K / 2), 64, 2), element [b, p, j, t] = weight[64 b + j, 2 p + t], zeros past N and K."""
    weight = weight.detach().contiguous()
    N, K = weight.shape
    blocks, pairs = -(-N // BF16_PACK_COLS), -(-K // 2)
    packed = torch.empty(blocks, pairs, BF16_PACK_COLS, 2, dtype=torch.bfloat16)
    library().bf16_pack(weight.data_ptr(), packed.data_ptr(), N, K, torch.get_num_threads())
    return packed


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) fp32 rounded to bf16, times the weight (out_features, K) that bf16_pack packed, summed in fp32,
    rounded to bf16, as fp32 (M, out_features), plus an fp32 bias (out_features,) (bf16_linear.c)."""
    x = x.contiguous()
    M, K = x.shape
    blocks, pairs = -(-out_features // BF16_PACK_COLS), -(-K // 2)
    if (
        tuple(packed.shape) != (blocks, pairs, BF16_PACK_COLS, 2)
        or packed.dtype != torch.bfloat16
        or not packed.is_contiguous()
    ):
        raise ValueError(f"a packed bf16 weight of {out_features} x {K} is ({blocks}, {pairs}, 64, 2) bf16")
    y = torch.empty(M, out_features, dtype=torch.float32)
    x16 = torch.empty(M, 2 * pairs, dtype=torch.bfloat16)  # the kernel's scratch for the rounded inputs
    bias = bias.contiguous() if bias is not None else None
    library().bf16_linear(
        x.data_ptr(),
        packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        M,
        out_features,
        K,
        x16.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def _build(march: str) -> Path:
    """Compile SOURCES for `march` into the cache (once per source, compiler, flags and CPU) and return the
    library's path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    flags = [*FLAGS, f"-march={march}"]
    sources = [path.read_bytes() for path in SOURCES + HEADERS]
    key = hashlib.sha256(b"\0".join([*sources, compiler.encode(), " ".join(flags).encode(), _cpu_identity()]))
    target = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes that build at once (torchrun ranks) never load a
    # half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", partial], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            names = ", ".join(path.name for path in SOURCES)
            raise KernelBuildError(f"{compiler} failed on {names} (in {HERE}):\n{done.stderr.strip()}")
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building the kernels in {HERE} with {compiler}: {e}") from e
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _cpu_identity() -> bytes:
    """What -march=native depends on: the machine and, on Linux, the CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                parts.append(line)
            if line.strip() == "":  # the first processor is enough
                break
    except OSError:
        pass
    return "\n".join(parts).encode()


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 times an fp32 weight (N, K), plus bias (N,) -> (M, N) fp32, the output rows split over
    torch's threads (f32_linear.c: for a few input rows, where MKL runs on one thread)."""
    x, weight = x.contiguous(), weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(M, N, dtype=torch.float32)
    library().f32_linear(
        x.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        M,
        N,
        K,
        torch.get_num_threads(),
    )
    return y

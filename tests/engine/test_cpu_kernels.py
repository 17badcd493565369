"""The native CPU decode kernels (posttrain/kernels) against the PyTorch reference, and their build."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from posttrain import kernels
from posttrain.models.attention import PagedAttentionMetadata
from posttrain.models.paged_attention import paged_attention, reference_paged_attention, write_kv

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="no C compiler with OpenMP here")


def _decode_step(
    rng: random.Random,
    bs: int,
    hkv: int,
    heads_per_kv: int,
    D: int,
    groups: list[tuple[int, int]],
    num_blocks: int = 400,
    scale: float = 1.0,
):
    """A pure decode step: groups of (members, shared prompt tokens) in batch order; each member has
    1-40 tokens of its own after the shared prompt. Blocks are scattered over the pool."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, ctx = [], []
    for members, prompt in groups:
        shared = [free.pop() for _ in range(prompt // bs)]
        for _ in range(members):
            length = prompt + rng.randint(1, 40)
            own = [free.pop() for _ in range(-(-length // bs) - len(shared))]
            tables.append(shared + own)
            ctx.append(length)
    width = max(len(t) for t in tables)
    S, H = len(tables), hkv * heads_per_kv
    slots = torch.tensor([t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, ctx)])
    cache = torch.randn(2, num_blocks, bs, hkv, D) * scale
    meta = PagedAttentionMetadata(
        [cache],
        slots,
        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor(ctx),
        torch.ones(S, dtype=torch.long),
        1,
    )
    q, k, v = torch.randn(S, H, D) * scale, torch.randn(S, hkv, D) * scale, torch.randn(S, hkv, D)
    return q, k, v, meta


def _with_cache(meta: PagedAttentionMetadata, cache: torch.Tensor) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(
        [cache], meta.slot_mapping, meta.block_tables, meta.context_lens, meta.query_lens, meta.max_query_len
    )


@needs_kernels
@pytest.mark.parametrize(
    "bs, hkv, heads_per_kv, D",
    # SmolLM2's shapes; MHA; 32-token blocks (two 16-score vectors a block on AVX-512); MQA + a 64+8 head (the
    # 8-lane path); an 8-dim head
    [(16, 3, 3, 64), (16, 2, 1, 128), (32, 2, 2, 32), (8, 1, 4, 72), (4, 2, 3, 8)],
)
def test_decode_kernel_matches_reference(bs: int, hkv: int, heads_per_kv: int, D: int, kernel_march: str) -> None:
    rng = random.Random(bs + D)
    torch.manual_seed(D)
    # Siblings of one prompt (cascade), a lone sequence, a group whose prompt is under one block
    # (nothing to share), and siblings sharing 3 blocks.
    groups = [(5, 2 * bs + 3), (1, bs), (3, bs - 1), (8, 3 * bs)]
    q, k, v, meta = _decode_step(rng, bs, hkv, heads_per_kv, D, groups)
    reference_cache = meta.kv_caches[0].clone()
    out = paged_attention(q, k, v, meta, 0)
    expected = reference_paged_attention(q, k, v, _with_cache(meta, reference_cache), 0)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(meta.kv_caches[0], reference_cache)  # the K/V writes, byte for byte


@needs_kernels
def test_decode_kernel_is_exact_on_peaked_and_flat_scores(kernel_march: str) -> None:
    """Large scores (a running max that jumps across blocks, weights that underflow to 0) and tiny ones
    (a flat softmax): the online softmax stays exact, measured against an fp64 softmax. With scores in the
    hundreds, fp32 rounding of the scores alone moves outputs by up to ~5e-4 (PyTorch's fp32 path as much as
    the kernel, each in its own order of summation), so that case gets that tolerance; a wrong rescale or an
    overflow would be off by the size of the values (~1)."""
    for seed, scale, atol in [(1, 12.0, 2e-3), (2, 12.0, 2e-3), (1, 1e-3, 1e-6)]:
        torch.manual_seed(seed)
        q, k, v, meta = _decode_step(random.Random(seed), 16, 3, 3, 64, [(4, 40), (1, 0)], scale=scale)
        reference_cache = meta.kv_caches[0].clone()
        out = paged_attention(q, k, v, meta, 0)
        fp64 = reference_paged_attention(
            q.double(), k.double(), v.double(), _with_cache(meta, reference_cache.double()), 0
        )
        torch.testing.assert_close(out.double(), fp64, atol=atol, rtol=0)


@needs_kernels
def test_decode_kernel_and_pytorch_path_agree_in_mixed_steps(
    monkeypatch: pytest.MonkeyPatch, kernel_march: str
) -> None:
    """Decode rows between prefill rows: the native and the PyTorch fast paths give the same outputs and
    the same cache."""
    from tests.engine.test_paged_attention import _layout

    rng = random.Random(7)
    torch.manual_seed(7)
    tables, ctx, qlens = _layout(rng, 120)
    width = max(len(t) for t in tables)
    slots = [t[p // 4] * 4 + p % 4 for t, c, n in zip(tables, ctx, qlens) for p in range(c - n, c)]
    N = sum(qlens)
    q, k, v = torch.randn(N, 6, 8), torch.randn(N, 2, 8), torch.randn(N, 2, 8)
    cache = torch.randn(2, 120, 4, 2, 8)
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(kernels, "supports", lambda q, cache: False)
        meta = PagedAttentionMetadata(
            [cache.clone()],
            torch.tensor(slots),
            torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            torch.tensor(ctx),
            torch.tensor(qlens),
            max(qlens),
        )
        results.append((paged_attention(q, k, v, meta, 0), meta.kv_caches[0]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-6, rtol=1e-5)
    assert torch.equal(results[0][1], results[1][1])


@needs_kernels
def test_native_write_kv_skips_negative_slots(kernel_march: str) -> None:
    cache = torch.randn(2, 10, 4, 2, 8)
    expected = cache.clone()
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 39, -1])
    kernels.write_kv(cache, k, v, slots)
    write_kv(expected, k, v, slots)
    assert torch.equal(cache, expected)


def test_supports_only_fp32_cpu_pools_with_whole_vectors() -> None:
    cache = torch.zeros(2, 4, 4, 2, 8)
    q = torch.zeros(3, 4, 8)
    available = kernels.library() is not None
    assert kernels.supports(q, cache) is available
    assert not kernels.supports(q.double(), cache.double())
    assert not kernels.supports(q, torch.zeros(2, 4, 4, 2, 12))  # head_dim not a multiple of 8
    assert not kernels.supports(q, torch.zeros(1, 4, 4, 1, 8))  # a latent-attention pool


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """library() rebuilt from scratch into an empty cache, and forgotten again after the test."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    kernels.library.cache_clear()
    yield tmp_path
    kernels.library.cache_clear()


def test_kernels_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, fresh_library) -> None:
    monkeypatch.setenv("POSTTRAIN_CPU_KERNELS", "0")
    assert kernels.library() is None
    assert not kernels.supports(torch.zeros(3, 4, 8), torch.zeros(2, 4, 4, 2, 8))
    assert not (fresh_library / "kernels").exists()  # nothing was built


def test_failed_build_falls_back_with_the_compilers_message(
    monkeypatch: pytest.MonkeyPatch, fresh_library, caplog: pytest.LogCaptureFixture
) -> None:
    script = fresh_library / "broken-cc"
    script.write_text("#!/bin/sh\necho 'cc: error: no such flag -march=native' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    with caplog.at_level(logging.WARNING, logger="posttrain.kernels"):
        assert kernels.library() is None
    assert "no such flag -march=native" in caplog.text and "paged_decode.c" in caplog.text
    assert not any(p.suffix == ".so" for p in (fresh_library / "kernels").iterdir())  # nothing half-written kept
    # The attention still runs, in PyTorch.
    q, k, v, meta = _decode_step(random.Random(0), 4, 2, 3, 8, [(3, 9), (1, 0)])
    reference_cache = meta.kv_caches[0].clone()
    torch.testing.assert_close(
        paged_attention(q, k, v, meta, 0), reference_paged_attention(q, k, v, _with_cache(meta, reference_cache), 0)
    )


@needs_kernels
def test_build_is_cached_per_source(fresh_library) -> None:
    assert kernels.library() is not None
    built = sorted((fresh_library / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
    kernels.library.cache_clear()
    mtime = built[0].stat().st_mtime_ns
    assert kernels.library() is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded again, not rebuilt


def _openmp_compiler(workdir: Path) -> str | None:
    """The compiler the build would use (CC, cc, gcc), if it can make an OpenMP shared library at all."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    probe = workdir / "probe.c"
    probe.write_text("#include <omp.h>\nint probe(void) { return omp_get_max_threads(); }\n")
    done = subprocess.run(
        [compiler, "-fopenmp", "-shared", "-fPIC", str(probe), "-o", str(workdir / "probe.so")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return compiler if done.returncode == 0 else None


def test_the_kernels_build_wherever_a_c_compiler_with_openmp_is_present(
    monkeypatch: pytest.MonkeyPatch, fresh_library
) -> None:
    """The kernel tests skip when library() is None, so a kernel source that stops compiling would turn
    them into silent skips. Where the compiler builds a trivial OpenMP library, the kernels must build
    (a failure raises KernelBuildError with the compiler's message) and export every function."""
    workdir = fresh_library / "probe"
    workdir.mkdir()
    if _openmp_compiler(workdir) is None:
        pytest.skip("no C compiler that builds an OpenMP shared library here")
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    lib = ctypes.CDLL(str(kernels._build(kernels.target_march())))
    missing = [name for name in kernels.SIGNATURES if not hasattr(lib, name)]
    assert not missing, f"the built kernels do not export {missing}"
    assert kernels.library() is not None


@needs_kernels
def test_each_target_gets_its_own_build(monkeypatch: pytest.MonkeyPatch, fresh_library) -> None:
    if kernels.runs_here("x86-64-v3") is not True:
        pytest.skip("this CPU does not run x86-64-v3 code")
    monkeypatch.setenv(kernels.MARCH_ENV, "native")
    assert kernels.library() is not None
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3")
    kernels.library.cache_clear()
    assert kernels.library() is not None
    assert len(list((fresh_library / "kernels").glob("*.so"))) == 2  # one per -march, neither loaded for the other


def test_a_target_this_cpu_lacks_is_refused(
    monkeypatch: pytest.MonkeyPatch, fresh_library, caplog: pytest.LogCaptureFixture
) -> None:
    """Code for an instruction set the CPU lacks would die of SIGILL on its first call: not built, not loaded."""
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    avx2_only = " ".join(sorted(kernels.X86_LEVELS["x86-64-v3"]))
    monkeypatch.setattr(kernels, "_cpu_identity", lambda: f"x86_64\nflags\t\t: {avx2_only}".encode())
    assert kernels.runs_here("x86-64-v3") is True and kernels.runs_here("x86-64-v4") is False
    assert kernels.runs_here("znver5") is None  # not a level we know the needs of: left to the compiler
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v4")
    with caplog.at_level(logging.WARNING, logger="posttrain.kernels"):
        assert kernels.library() is None
    assert "POSTTRAIN_CPU_KERNELS_MARCH=x86-64-v4 names an instruction set this CPU lacks" in caplog.text
    assert not (fresh_library / "kernels").exists()

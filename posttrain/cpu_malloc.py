"""When glibc's malloc gives freed CPU tensor memory back to the OS, per phase of a run.

PyTorch's CPU tensors come from malloc, and glibc's defaults suit neither of posttrain's two phases:

- glibc as it comes raises its mmap threshold as large blocks are freed (up to 32 MiB), so tensors the
  size of a small model's activations come from the heap, and the holes they leave between tensors still
  alive stay resident. A training process then sits 10-35% above its live tensors (benchmarks/estimate.py).
- `hold` (the rollout engine): every allocation from the heap and no trimming, so a decode step's large
  temporaries reuse pages already mapped instead of page-faulting fresh ones each step (several times
  faster decode steps on CPU). Resident memory stays at its high-water mark.
- `release` (training): blocks of 128 KiB or more are mmapped and unmapped when freed, and the heap is
  trimmed once 128 KiB at its top are free, so resident memory follows the live tensors, which is what
  `posttrain estimate` counts. The price is the page faults of touching fresh pages each step.

A process starts under glibc's own policy (`default`). glibc cannot be put back into it (any threshold set
by mallopt stays fixed), so leaving a `hold` entered from `default` keeps `hold`: a process that only
generates keeps the engine's policy, as before.

Only glibc has these knobs: elsewhere (macOS, musl) every call here does nothing and the policy stays
`default`.

`advise_huge_pages` asks Linux to back a long-lived buffer (the engine's KV pool) with 2 MiB pages, and
`zeroed_pages` makes such a buffer from fresh anonymous pages, which the OS zeroes when first touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

Policy = Literal["default", "hold", "release"]
POLICIES: tuple[str, ...] = ("default", "hold", "release")

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
RELEASE_THRESHOLD = 128 * 1024  # glibc's own initial mmap and trim thresholds, here kept fixed
GLIBC_MMAP_MAX = 65536  # glibc's default cap on the number of mmapped blocks
NEVER_TRIM = 2**31 - 1  # the largest int: the heap top is returned only past 2 GiB free
MADV_HUGEPAGE = 14  # madvise advice (Linux)
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages)

_policy: Policy = "default"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The process's C library, or None where there is none to load (looked up once: find_library may
    run ldconfig)."""
    if os.name != "posix":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """libc with mallopt and malloc_trim, or None when this is not glibc (looked up once)."""
    libc = _libc()
    try:
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except AttributeError:  # no libc, musl, macOS: nothing to tune
        return None
    return libc


def current_malloc_policy() -> Policy:
    return _policy


def set_malloc_policy(policy: Policy) -> Policy:
    """Apply `policy` process-wide; returns the previous one. `default` cannot be re-applied once another
    policy was set (see the module docstring): asking for it then leaves the current policy in place."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"malloc policy {policy!r} is not one of {', '.join(POLICIES)}")
    previous = _policy
    libc = _glibc()
    if libc is None or policy == previous or policy == "default":
        return previous
    if policy == "hold":
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    else:
        libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
        libc.mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, RELEASE_THRESHOLD)
        libc.malloc_trim(0)  # what a hold phase left free in the heap goes back now, not at its next trim
    _policy = policy
    return previous


def return_free_memory() -> bool:
    """Hand the free pages of glibc's heap back to the OS now (`malloc_trim(0)`: the top and the free pages
    between live blocks), whatever the policy. Under `hold` nothing else ever does, so a long run that alternates
    phases of different shapes (a rollout's temporaries, an update's activations) stays resident at the high-water
    mark of all of them plus the holes between. Returns whether glibc released any memory (False off glibc)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@contextmanager
def malloc_policy(policy: Policy) -> Iterator[None]:
    """`policy` for the duration of the block, then the previous one (a previous `default` stays
    whatever the block set: glibc's own policy cannot be restored)."""
    previous = set_malloc_policy(policy)
    try:
        yield
    finally:
        set_malloc_policy(previous)


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back [address, address + nbytes) with transparent huge pages where the range covers
    whole 2 MiB pages, before it is first touched. Returns whether the advice was taken.

    For the engine's KV pool: decode reads and writes a few KiB in each of thousands of scattered blocks per
    layer, and with 4 KiB pages nearly every one is a TLB miss (dearer still under a hypervisor). Measured on
    the 2-core development VM, 512 sequences: the decode attention of one layer 6.9 -> 4.9 ms. The price is
    paid once, when the pool is first touched: the kernel may compact memory to find free huge pages.
    Does nothing (False) off Linux, or where transparent huge pages are off.
    """
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux"):
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on fresh anonymous pages (a private mmap of its own, unmapped when the tensor goes),
    advised to 2 MiB pages (`advise_huge_pages`). Nothing is written now: the OS hands each page out zeroed when it
    is first touched. So a large pool costs what is used of it, where zeroing it up front touched every page: the
    engine's default KV pool (6.1 GB for SmolLM2-135M on a 24 GiB machine) took 11 s to allocate on a 2-core VM,
    most of it never used by a chat session. Under the `hold` policy malloc would hand out heap pages that may
    hold old data; this bypasses malloc."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=dtype).view(shape)  # keeps `region` alive as long as it lives
    advise_huge_pages(tensor.data_ptr(), nbytes)
    return tensor

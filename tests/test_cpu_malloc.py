"""glibc malloc policies (posttrain.cpu_malloc): what each does to resident memory, how phases nest, and who
sets them. The policy is process-wide, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from posttrain.cpu_malloc import set_malloc_policy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc policies (Linux)")

# Allocate 48 tensors of 1.5 MiB (below glibc's adaptive mmap ceiling, so the policy decides where they
# live), free them all, and report how much of the 72 MiB is still resident.
PROBE = """
import json, os, torch
from posttrain.cpu_malloc import current_malloc_policy, malloc_policy, set_malloc_policy

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def retained():
    before = rss()
    blocks = [torch.ones(384 * 1024) for _ in range(48)]
    held = rss()
    del blocks
    return (rss() - before) / 2**20, (held - before) / 2**20

out = {}
{body}
print(json.dumps(out))
"""


def run_probe(body: str) -> dict:
    code = PROBE.replace("{body}", textwrap.dedent(body))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_release_returns_freed_tensors_and_hold_keeps_them() -> None:
    out = run_probe("""
        set_malloc_policy("release")
        out["release"] = retained()
        set_malloc_policy("hold")
        out["hold"] = retained()
        out["policy"] = current_malloc_policy()
    """)
    kept_release, peak_release = out["release"]
    kept_hold, peak_hold = out["hold"]
    assert peak_hold > 60 and peak_release > 60  # the 72 MiB were resident while alive
    assert kept_release < 8  # release: unmapped as they were freed
    assert kept_hold > 60  # hold: the heap keeps them
    assert out["policy"] == "hold"


def test_hold_scope_gives_back_what_it_kept_and_restores_release() -> None:
    out = run_probe("""
        with malloc_policy("hold"):
            out["inside_from_default"] = current_malloc_policy()
        out["after_default"] = current_malloc_policy()  # glibc's own cannot come back: hold stays
        set_malloc_policy("release")
        with malloc_policy("hold"):
            out["inside"] = current_malloc_policy()
            out["kept_inside"] = retained()[0]
            inside = rss()
        out["after"] = current_malloc_policy()
        out["trimmed"] = (inside - rss()) / 2**20  # leaving the scope trims the heap
    """)
    assert out["inside_from_default"] == out["after_default"] == "hold"
    assert out["inside"] == "hold" and out["after"] == "release"
    assert out["kept_inside"] > 60 and out["trimmed"] > 60


def test_return_free_memory_gives_back_what_hold_kept() -> None:
    out = run_probe("""
        from posttrain.cpu_malloc import return_free_memory
        set_malloc_policy("hold")
        out["kept"] = retained()[0]
        before = rss()
        out["returned"] = return_free_memory()
        out["trimmed"] = (before - rss()) / 2**20
        out["policy"] = current_malloc_policy()
    """)
    assert out["kept"] > 60  # hold alone keeps the 72 MiB resident
    assert out["returned"] and out["trimmed"] > 60 and out["policy"] == "hold"  # trimmed, the policy unchanged


def test_trainers_set_release_on_cpu_unless_told_to_keep() -> None:
    body = """
        from posttrain.distributed.config import DistSection
        from posttrain.distributed.processes import join_processes
        from posttrain.trainers.sections import ModelSection
        join_processes(DistSection(), ModelSection(device="cpu", cpu_memory={choice!r}))
        out["policy"] = current_malloc_policy()
    """
    assert run_probe(body.format(choice="release"))["policy"] == "release"
    assert run_probe(body.format(choice="keep"))["policy"] == "default"
    assert run_probe(body.replace(", cpu_memory={choice!r}", ""))["policy"] == "default"  # keep by default


def test_engine_holds_while_generating_then_gives_the_trainer_release_back() -> None:
    out = run_probe("""
        from posttrain.engine import LLM, SamplingParams
        from tests.data.tiny import tiny_model
        set_malloc_policy("release")
        llm = LLM(model=tiny_model(), num_kv_blocks=64)
        out["after_init"] = current_malloc_policy()
        seen = []
        step = llm.engine.step
        llm.engine.step = lambda: (seen.append(current_malloc_policy()), step())[1]
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        out["during"] = sorted(set(seen))
        out["after"] = current_malloc_policy()
    """)
    assert out == {"after_init": "release", "during": ["hold"], "after": "release"}


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'lean' is not one of default, hold, release"):
        set_malloc_policy("lean")  # type: ignore[arg-type]


def test_zeroed_pages_are_zeros_that_take_memory_only_where_touched() -> None:
    """The KV pool's allocation: zeros without writing them (under `hold` too, where malloc would hand out heap
    pages that held other tensors), resident only once touched, and given back when the tensor goes."""
    out = run_probe("""
        import torch
        from posttrain.cpu_malloc import zeroed_pages
        set_malloc_policy("hold")
        junk = torch.full((64 * 2**20,), 7.0); del junk  # 256 MiB of sevens back in the held heap
        before = rss()
        pool = zeroed_pages((2, 64, 2**20), torch.bfloat16)  # 256 MiB
        out["untouched_mib"] = (rss() - before) / 2**20
        out["zeros"] = bool((pool[:, ::4096] == 0).all()) and bool((pool[1, 63, -8:] == 0).all())
        pool[0, :16].fill_(1.5)  # 32 MiB
        out["touched_mib"] = (rss() - before) / 2**20
        out["shape"], out["dtype"] = list(pool.shape), str(pool.dtype)
        del pool
        out["freed_mib"] = (rss() - before) / 2**20
    """)
    assert out["zeros"] and out["shape"] == [2, 64, 2**20] and out["dtype"] == "torch.bfloat16"
    assert out["untouched_mib"] < 48  # nothing written up front (reading every 4096th value maps a few pages)
    assert 28 < out["touched_mib"] < 96  # what was written, in whole (possibly 2 MiB) pages
    assert out["freed_mib"] < 16  # unmapped with the tensor

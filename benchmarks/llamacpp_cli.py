"""llama.cpp's two benchmark tools as benchmarks/vs_llamacpp.py drives them: their command lines and their output.

    settings = LlamaSettings(kv_type="f32", flash_attn="on")
    batched_bench_command(tools, gguf, sequences=256, max_tokens=128, prompt_tokens=95, shared=True,
                          threads=2, settings=settings)     # llama-batched-bench ... --output-format jsonl
    llama_bench_command(tools, gguf, max_tokens=128, depth=95, repetitions=5, threads=2, grid=[settings, ...])

- `llama-batched-bench` decodes S sequences at once after their prompts: with `-pps` all S share one prompt
  (copied into each sequence's cache), without it each has its own. Its `speed_tg` is decode tokens/s, the
  prompts' processing left out.
- `llama-bench -p 0 -n T -d D -r R` decodes T tokens at batch 1 after a D-token context, R times, and reports the
  mean and standard deviation of tokens/s. Every list flag takes several values, so one process measures a grid
  of settings (`-fa off,on --repack 0,1 ...`): each combination is one JSON record.

`LlamaSettings` is what vs_llamacpp.py varies to find llama.cpp at its best: flash attention, the repacked CPU
weight layouts (`--repack`, on by default: Q8_0 and others interleaved for the AVX-512 / VNNI kernels), strict
thread pinning (`--cpu-strict 1`), and for batched runs the unified KV buffer. The KV cache type is not varied:
it is set to the precision posttrain's side keeps its KV in (llama.cpp's default is F16 whatever the weights).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

KV_TYPES = ("f32", "f16", "bf16", "q8_0")
LLAMA_BENCH_KV_TYPES = ("f16", "bf16", "q8_0")  # llama-bench's -ctk parser (this version) refuses f32


@dataclass(frozen=True)
class LlamaSettings:
    kv_type: str = "f16"  # -ctk / -ctv
    flash_attn: str = "off"  # -fa on|off
    repack: bool = True  # --repack 1|0 (llama-batched-bench: --no-repack when off)
    cpu_strict: bool = False  # --cpu-strict 1: each thread pinned to its own core
    kv_unified: bool = False  # llama-batched-bench only: one KV buffer for all sequences (-kvu)

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type {self.kv_type!r}: one of {', '.join(KV_TYPES)}")
        if self.flash_attn not in ("on", "off"):
            raise ValueError(f"flash_attn {self.flash_attn!r}: 'on' or 'off'")

    def batched_flags(self) -> list[str]:
        flags = ["-ctk", self.kv_type, "-ctv", self.kv_type, "-fa", self.flash_attn]
        if not self.repack:
            flags.append("--no-repack")
        if self.cpu_strict:
            flags += ["--cpu-strict", "1"]
        if self.kv_unified:
            flags.append("-kvu")
        return flags

    def label(self) -> str:
        parts = [f"kv {self.kv_type}", f"fa {self.flash_attn}", f"repack {int(self.repack)}"]
        parts += [f"strict {int(self.cpu_strict)}", f"kvu {int(self.kv_unified)}"]
        return ", ".join(parts)


def settings_grid(kv_type: str, batched: bool) -> list[LlamaSettings]:
    """The settings tried: flash attention x repacking x strict pinning (x a unified KV buffer when batched)."""
    unified = (False, True) if batched else (False,)
    return [
        LlamaSettings(kv_type=kv_type, flash_attn=fa, repack=repack, cpu_strict=strict, kv_unified=kvu)
        for fa, repack, strict, kvu in itertools.product(("off", "on"), (True, False), (False, True), unified)
    ]


def batched_bench_command(
    tools: Path,
    gguf: Path,
    *,
    sequences: int,
    max_tokens: int,
    prompt_tokens: int,
    shared: bool,
    threads: int,
    settings: LlamaSettings,
    runs: int = 1,
) -> list[str]:
    """llama-batched-bench decoding `sequences` x `max_tokens` after `prompt_tokens`-token prompts (one shared
    prompt with `shared`, else one each), `runs` times in one process (the cache cleared between), printing JSON
    lines."""
    prompts = 1 if shared else sequences
    context = prompts * prompt_tokens + sequences * max_tokens + 256
    command = [
        str(tools / "bin" / "llama-batched-bench"),
        *("-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512"),
        *("-npp", str(prompt_tokens), "-ntg", str(max_tokens), "-npl", ",".join([str(sequences)] * runs)),
        *(["-pps"] if shared else []),
        *("-t", str(threads), "-tb", str(threads)),
        *settings.batched_flags(),
        *("--output-format", "jsonl"),
    ]
    return command


def llama_bench_command(
    tools: Path,
    gguf: Path,
    *,
    max_tokens: int,
    depth: int,
    repetitions: int,
    threads: int,
    grid: list[LlamaSettings],
) -> list[str]:
    """llama-bench at batch 1: `max_tokens` decoded after a `depth`-token context, `repetitions` times, for every
    combination of the values the settings in `grid` take (llama-bench crosses its list flags), as JSON."""

    def values(field: str, form) -> str:  # noqa: ANN001 (a value -> its flag text)
        seen = dict.fromkeys(form(getattr(s, field)) for s in grid)  # ordered, unique
        return ",".join(seen)

    kv = values("kv_type", str)
    return [
        str(tools / "bin" / "llama-bench"),
        *("-m", str(gguf), "-p", "0", "-n", str(max_tokens), "-d", str(depth), "-r", str(repetitions)),
        *("-t", str(threads), "-ctk", kv, "-ctv", kv),
        *("-fa", values("flash_attn", str), "--repack", values("repack", lambda v: str(int(v)))),
        *("--cpu-strict", values("cpu_strict", lambda v: str(int(v)))),
        *("-o", "json"),
    ]


def parse_batched_bench(output: str) -> list[tuple[int, float]]:
    """(parallel sequences, decode tokens/s `speed_tg`) for each run, in order, from llama-batched-bench's JSON
    lines (other lines, its log, are skipped)."""
    runs = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            runs.append((int(record["pl"]), float(record["speed_tg"])))
    return runs


def parse_llama_bench(output: str) -> list[dict]:
    """llama-bench's JSON records, each as the settings it ran (`LlamaSettings` fields) with `mean`, `stddev` and
    `samples` tokens/s. Records of other tests (prompt processing) are left out."""
    records = []
    for record in json.loads(output):
        if int(record.get("n_gen", 0)) == 0:
            continue
        # llama-bench names its flash-attention field by version: a bool `flash_attn` or a type name.
        fa = record.get("flash_attn", record.get("flash_attn_type", 0))
        fa_on = fa is True or str(fa).lower() in ("1", "on", "true", "enabled")
        settings = LlamaSettings(
            kv_type=str(record.get("type_k", "f16")),
            flash_attn="on" if fa_on else "off",
            repack=bool(record.get("repack", not record.get("no_extra_bufts", False))),
            cpu_strict=bool(record.get("cpu_strict", False)),
        )
        records.append(
            {
                "settings": asdict(settings),
                "mean": float(record["avg_ts"]),
                "stddev": float(record["stddev_ts"]),
                "samples": [float(x) for x in record.get("samples_ts", [])],
                "build": f"{record.get('build_commit', '?')} ({record.get('build_number', '?')})",
            }
        )
    return records


def version_info(tools: Path) -> dict:
    """What build_llamacpp.sh recorded about the build (the pinned llama-cpp-python sdist, its sha256, the
    vendored ggml version, cmake flags); `{"unknown": ...}` for a build made some other way."""
    path = tools / "llamacpp_version.json"
    if not path.exists():
        return {"unknown": f"{path} is missing (build with benchmarks/build_llamacpp.sh to record the version)"}
    return json.loads(path.read_text())

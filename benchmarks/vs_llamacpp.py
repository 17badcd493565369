"""posttrain's engine against llama.cpp at its best on this CPU: the same work, the same precision, alternated rounds.

    bash benchmarks/build_llamacpp.sh /tmp/llamacpp HF_DIR    # once: llama.cpp's pinned tools + GGUFs of HF_DIR
    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp /tmp/llamacpp --hf-dir HF_DIR
    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp /tmp/llamacpp --hf-dir HF_DIR --quick   # a smoke run
    .venv/bin/python benchmarks/vs_llamacpp.py --dry-run      # the plan (workloads, llama.cpp's settings grid)

HF_DIR is posttrain's own export of the model (`posttrain convert --out HF_DIR`); both sides run those weights
(DIR/smollm2-{f32,bf16,q8_0}.gguf are their conversions by llama.cpp's own converter; a missing one is converted).

Three workloads, every prompt exactly 95 tokens (windows of chat-templated GSM8K questions), warm-up excluded and
the same threads on both sides, decode only (llama.cpp's figures leave the prompts' processing out; posttrain's
leave out a timed run with max_tokens=1: the prefill and each sequence's first token):
- shared: S sequences x T tokens after one shared prompt. llama.cpp `llama-batched-bench -npl S -pps` (the prompt
  processed once, copied to each sequence); posttrain one prompt with n=S samples (its prefix cache shares the
  prompt's KV blocks). Sampled at temperature 1 on posttrain's side, EOS ignored on both.
- distinct: S sequences x T tokens, each after its own prompt. llama.cpp without `-pps`; posttrain S prompts, n=1.
- batch 1: T tokens greedy after one prompt, R repetitions (mean and stddev). llama.cpp `llama-bench -p 0 -n T
  -d 95 -r R`; posttrain the same prompt R times (plus, once, one decode step at a time: `one_step_identical`).

Precision is matched on both sides, the KV cache included: llama.cpp F32 (KV f32) against posttrain fp32, BF16
(KV bf16) against posttrain's `compute_dtype="auto"` where that is bf16 (on a CPU without fast bf16 auto is fp32,
and llama.cpp's KV is then f32 too: the JSON names both), Q8_0 (KV f32) against posttrain `quant="q8_0"` (weights
and LM head rounded by 32 as the Q8_0 file is, activations rounded to int8 before each product, fp32 KV).

llama.cpp at its best: before measuring, each precision tries llama.cpp's own settings (flash attention,
repacked weights, strict thread pinning, a unified KV buffer for the shared prompt: benchmarks/llamacpp_cli.py) on a
shorter run and keeps the fastest for each workload (`tuning` in the JSON lists every setting's figure;
`--no-tune`: llama.cpp's defaults with the matched KV type).

`--rounds R` (default 2) alternates the sides (llama.cpp first in odd rounds, posttrain first in even ones); each
figure is the median over rounds and each ratio the median of the rounds' own ratios, with their min and max.
The machine's roofs are measured in the same run (benchmarks/roofs.py: memory bandwidth and matmul GFLOP/s), and
every figure is also given as a fraction of its roof: batch 1 as bytes streamed (the GGUF's size a token) over
the bandwidth, batched as 2 x parameters FLOPs a token over the matmul rate of the compute dtype.

Prints progress to stderr and one JSON object as the last line of stdout: per precision, per workload, both
sides' tokens/s, `ratio` (posttrain / llama.cpp; above 1: posttrain is faster), and the settings of both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from alternation import ratio_summary, round_order  # noqa: E402
from llamacpp_cli import (  # noqa: E402
    LLAMA_BENCH_KV_TYPES,
    LlamaSettings,
    batched_bench_command,
    llama_bench_command,
    parse_batched_bench,
    parse_llama_bench,
    settings_grid,
    version_info,
)

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"
PRECISIONS = ("f32", "bf16", "q8_0")
PROMPT_TOKENS = 95  # the length of a chat-templated GSM8K question
MAX_PARALLEL = 256  # llama.cpp's limit on parallel sequences
WORKLOADS = ("shared", "distinct", "batch1")


@dataclass(frozen=True)
class Workload:
    sequences: int  # S, the batched workloads' parallel sequences
    max_tokens: int  # T, decoded per sequence
    repetitions: int  # R, llama-bench's -r and posttrain's batch-1 repeats


FULL = Workload(sequences=256, max_tokens=128, repetitions=5)
QUICK = Workload(sequences=16, max_tokens=32, repetitions=2)
TUNE = Workload(sequences=64, max_tokens=32, repetitions=2)  # the settings search: shorter runs, the same shapes


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gguf_path(llamacpp: Path, precision: str) -> Path:
    return llamacpp / f"smollm2-{precision}.gguf"


def posttrain_compute(precision: str) -> str:
    """What posttrain's side computes (and keeps its KV) in: bf16's row runs `auto`."""
    if precision != "bf16":
        return "float32"
    from posttrain.hardware import auto_dtype

    return auto_dtype("cpu").dtype


def kv_type(precision: str) -> str:
    """llama.cpp's KV cache type matching posttrain's KV pool (which holds the compute dtype)."""
    return "bf16" if posttrain_compute(precision) == "bfloat16" else "f32"


# --- llama.cpp's side ---------------------------------------------------------------------------------------------


def convert_command(llamacpp: Path, hf_dir: Path, precision: str) -> list[str]:
    return [
        sys.executable,
        str(llamacpp / "convert_hf_to_gguf.py"),
        str(hf_dir),
        *("--outtype", precision, "--outfile", str(gguf_path(llamacpp, precision))),
    ]


def convert(llamacpp: Path, hf_dir: Path, precision: str) -> None:
    """The GGUF at `precision` from the HF export, with the build's converter; a failure is one line naming the
    converter's own last words (a module it could not import, a file it could not read)."""
    env = {**os.environ, "PYTHONPATH": str(llamacpp / "gguf-py")}
    command = convert_command(llamacpp, hf_dir, precision)
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(
            f"error: converting {hf_dir} to {gguf_path(llamacpp, precision)} failed ({done.returncode}): {last} "
            f"(benchmarks/build_llamacpp.sh DEST HF_DIR copies the converter with what it imports and installs "
            f"sentencepiece)"
        )


def run_tool(llamacpp: Path, command: list[str]) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": str(llamacpp / "bin")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr  # llama-batched-bench logs its JSON lines to stderr


class LlamaCppSide:
    """llama.cpp's figures for one precision: each call one fresh process of its tools."""

    def __init__(self, llamacpp: Path, precision: str, threads: int) -> None:
        self.llamacpp, self.gguf, self.threads = llamacpp, gguf_path(llamacpp, precision), threads

    def batched_runs(self, workload: Workload, shared: bool, settings: LlamaSettings, runs: int = 1) -> list[float]:
        command = batched_bench_command(
            self.llamacpp,
            self.gguf,
            sequences=workload.sequences,
            max_tokens=workload.max_tokens,
            prompt_tokens=PROMPT_TOKENS,
            shared=shared,
            threads=self.threads,
            settings=settings,
            runs=runs,
        )
        speeds = [speed for parallel, speed in parse_batched_bench(run_tool(self.llamacpp, command))]
        if len(speeds) != runs:
            sys.exit(f"error: {' '.join(command)} printed {len(speeds)} results, not {runs}")
        return speeds

    def batched(self, workload: Workload, shared: bool, settings: LlamaSettings) -> float:
        return self.batched_runs(workload, shared, settings)[0]

    def bench(self, workload: Workload, grid: list[LlamaSettings]) -> list[dict]:
        """llama-bench's batch 1 (`workload.max_tokens` after a 95-token context, R repetitions) over `grid`."""
        command = llama_bench_command(
            self.llamacpp,
            self.gguf,
            max_tokens=workload.max_tokens,
            depth=PROMPT_TOKENS,
            repetitions=workload.repetitions,
            threads=self.threads,
            grid=grid,
        )
        out = run_tool(self.llamacpp, command)
        start = out.find("[")
        records = parse_llama_bench(out[start : out.rfind("]") + 1]) if start >= 0 else []
        if not records:
            sys.exit(f"error: {' '.join(command)} printed no decode results")
        return records

    def batch1(self, workload: Workload, settings: LlamaSettings) -> dict:
        """Batch 1 at `settings`: llama-bench's mean and stddev over R repetitions; for a KV type llama-bench
        refuses (f32), R + 1 one-sequence runs of llama-batched-bench in one process, the first left out as its
        warm-up (llama-bench warms up too)."""
        if settings.kv_type in LLAMA_BENCH_KV_TYPES:
            (record,) = self.bench(workload, [settings])
            return {**record, "tool": "llama-bench"}
        one = dataclasses.replace(workload, sequences=1)
        samples = self.batched_runs(one, False, settings, runs=workload.repetitions + 1)[1:]
        stddev = statistics.stdev(samples) if len(samples) > 1 else 0.0
        return {"mean": statistics.mean(samples), "stddev": stddev, "samples": samples, "tool": "llama-batched-bench"}

    def tune(self, kv: str) -> tuple[dict[str, LlamaSettings], dict]:
        """The fastest settings for each workload, from TUNE-sized runs; and every setting's figure. Batch 1's
        grid runs in llama-bench, at f16 KV where llama-bench refuses the matched type (the weights' layout and
        the threads' pinning are what it chooses; the measured runs keep the matched KV)."""
        table: dict[str, list] = {"batch1": [], "shared": [], "distinct": []}
        bench_kv = kv if kv in LLAMA_BENCH_KV_TYPES else "f16"
        for record in self.bench(TUNE, settings_grid(bench_kv, batched=False)):
            table["batch1"].append({**record["settings"], "tokens_s": record["mean"], "build": record["build"]})
        fastest = max(table["batch1"], key=lambda r: r["tokens_s"])
        base = LlamaSettings(
            kv_type=kv, flash_attn=fastest["flash_attn"], repack=fastest["repack"], cpu_strict=fastest["cpu_strict"]
        )
        best = {"batch1": base}
        # Batched: the weight layout and pinning batch 1 chose, flash attention (x a unified KV buffer, which only
        # a shared prompt can use) tried on the batched runs themselves.
        for workload, unified in (("shared", (False, True)), ("distinct", (False,))):
            candidates = [
                dataclasses.replace(base, flash_attn=fa, kv_unified=kvu) for fa in ("off", "on") for kvu in unified
            ]
            for settings in candidates:
                speed = self.batched(TUNE, workload == "shared", settings)
                table[workload].append({**asdict(settings), "tokens_s": speed})
                log(f"  llama.cpp tuning {workload} [{settings.label()}]: {speed:.1f} tokens/s")
            fastest = max(table[workload], key=lambda r: r["tokens_s"])
            best[workload] = LlamaSettings(**{k: v for k, v in fastest.items() if k != "tokens_s"})
        return best, table

    def measure(self, workload: Workload, best: dict[str, LlamaSettings]) -> dict:
        batch1 = self.batch1(workload, best["batch1"])
        return {
            "shared": self.batched(workload, True, best["shared"]),
            "distinct": self.batched(workload, False, best["distinct"]),
            "batch1": batch1["mean"],
            "batch1_stddev": batch1["stddev"],
            "batch1_samples": batch1["samples"],
            "batch1_tool": batch1["tool"],
        }


# --- posttrain's side ---------------------------------------------------------------------------------------------


def fixed_prompts(tokenizer, count: int, length: int = PROMPT_TOKENS) -> list[list[int]]:  # noqa: ANN001
    """`count` distinct prompts of exactly `length` tokens: consecutive windows over chat-templated GSM8K questions
    (the content does not change decode's cost; the length does, and is llama.cpp's -npp / -d on the other side)."""
    stream: list[int] = []
    with open(GSM8K) as f:
        for line in f:
            message = [{"role": "user", "content": json.loads(line)["question"]}]
            stream += tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
            if len(stream) >= count * length:
                break
    if len(stream) < count * length:
        sys.exit(f"error: {GSM8K} holds {len(stream)} tokens, fewer than {count} prompts of {length}")
    return [stream[i * length : (i + 1) * length] for i in range(count)]


def decode_rate(llm, prompts: list[list[int]], params) -> tuple[float, list]:  # noqa: ANN001 (LLM, SamplingParams)
    """Decode tokens/s as llama.cpp counts them, and the outputs: the run with max_tokens=1 (the prompts' prefill
    and each sequence's first token, sampled from it) is timed too and taken out of the full run's time and tokens.
    Each run starts from an empty prefix cache."""
    runs = []
    for max_tokens in (1, params.max_tokens):
        llm.engine.weights_updated()  # an empty prefix cache: both runs prefill the prompts
        start = time.perf_counter()
        outputs = llm.generate(prompts, dataclasses.replace(params, max_tokens=max_tokens))
        runs.append((time.perf_counter() - start, sum(len(c.token_ids) for o in outputs for c in o.outputs)))
    (first_s, first_tokens), (all_s, all_tokens) = runs
    return (all_tokens - first_tokens) / (all_s - first_s), outputs


class PosttrainSide:
    """posttrain's engine for one precision, loaded once; its KV pool sized for the distinct workload."""

    def __init__(self, hf_dir: str, precision: str, workload: Workload, speculative: int) -> None:
        from posttrain.engine import LLM, SamplingParams

        self.compute = "auto" if precision == "bf16" else "float32"
        self.quant = "q8_0" if precision == "q8_0" else None
        self.speculative = speculative
        blocks = -(-workload.sequences * (PROMPT_TOKENS + workload.max_tokens + 16) // 16)
        self.llm = LLM(
            hf_dir,
            dtype="float32",
            compute_dtype=self.compute,
            quant=self.quant,
            num_kv_blocks=blocks,
            max_num_seqs=workload.sequences,
        )
        self.llm.engine.touch_kv_cache()  # the pool's pages faulted in now (llama.cpp clears its cache at start too)
        self.prompts = fixed_prompts(self.llm.tokenizer, workload.sequences)
        warm = min(2, workload.sequences)
        self.llm.generate(self.prompts[:warm], SamplingParams(n=warm, max_tokens=4, ignore_eos=True))  # warm-up
        self.llm.generate(self.prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        self.sampling = SamplingParams

    def measure(self, workload: Workload) -> dict:
        sampled = self.sampling(temperature=1.0, max_tokens=workload.max_tokens, ignore_eos=True)
        shared, _ = decode_rate(self.llm, self.prompts[:1], dataclasses.replace(sampled, n=workload.sequences))
        distinct, _ = decode_rate(self.llm, self.prompts[: workload.sequences], sampled)
        greedy = self.sampling(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
        samples, outputs = [], None
        for _ in range(workload.repetitions):
            rate, outputs = decode_rate(self.llm, self.prompts[:1], greedy)
            samples.append(rate)
        return {
            "shared": shared,
            "distinct": distinct,
            "batch1": statistics.mean(samples),
            "batch1_stddev": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            "batch1_samples": samples,
            "greedy": list(outputs[0].outputs[0].token_ids),
        }

    def settings(self) -> dict:
        runner = self.llm.engine.runner
        return {
            "weights": "float32",
            "compute_dtype": str(runner.compute_dtype).removeprefix("torch."),
            "kv_dtype": str(runner.compute_dtype).removeprefix("torch."),
            "quant": self.quant,
            "decode_steps": self.llm.engine.config.decode_steps,
        }

    def engine_over_module(self, **fields):  # noqa: ANN003, ANN201
        """Another batch-1 engine over this (already quantized) module with EngineConfig `fields`, warmed up."""
        from posttrain.engine import LLM

        llm = LLM(self.llm.engine.model, self.llm.tokenizer, compute_dtype=self.compute, max_num_seqs=1, **fields)
        llm.generate(self.prompts[:1], self.sampling(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        return llm

    def variants(self, workload: Workload, plain: list[int]) -> dict:
        """Batch 1 one decode step at a time (no chained steps: the same greedy tokens, or a bug) and, with
        `speculative`, with n-gram drafts (tokens/s, acceptance, identical output)."""
        greedy = self.sampling(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
        rate, outputs = decode_rate(self.engine_over_module(decode_steps=1), self.prompts[:1], greedy)
        out = {"batch1_one_step": rate, "one_step_identical": list(outputs[0].outputs[0].token_ids) == plain}
        if self.speculative:
            llm = self.engine_over_module(speculative={"method": "ngram", "num_tokens": self.speculative})
            before = llm.engine.stats()
            rate, outputs = decode_rate(llm, self.prompts[:1], greedy)
            after = llm.engine.stats()
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            out["batch1_speculative"] = rate
            out["speculative_acceptance"] = round(accepted / drafted, 3) if drafted else 0.0
            out["speculative_identical"] = list(outputs[0].outputs[0].token_ids) == plain
        return out


# --- the report ---------------------------------------------------------------------------------------------------


def summarize(rounds: list[tuple[dict, dict]]) -> dict:
    """One precision's workloads from its rounds of (llama.cpp's figures, posttrain's): per workload both sides'
    medians, the median of the rounds' own ratios (posttrain / llama.cpp), their min and max, every round."""
    report = {}
    for workload in WORKLOADS:
        summary = ratio_summary([ours[workload] for _, ours in rounds], [theirs[workload] for theirs, _ in rounds])
        report[workload] = {
            "posttrain": summary["ours_median"],
            "llamacpp": summary["theirs_median"],
            "ratio": summary["ratio_median"],
            "ratio_min": summary["ratio_min"],
            "ratio_max": summary["ratio_max"],
            "posttrain_rounds": summary["ours_rounds"],
            "llamacpp_rounds": summary["theirs_rounds"],
        }
    for side, index in (("posttrain", 1), ("llamacpp", 0)):
        report["batch1"][f"{side}_stddev"] = [round(r[index]["batch1_stddev"], 3) for r in rounds]
    return report


def roof_fractions(report: dict, roofs: dict, weight_bytes: int, parameters: int, compute: str) -> dict:
    """Each median as a fraction of its roof: batch 1 streams the weights once a token (bytes / bandwidth); a
    batched token costs 2 x parameters FLOPs (against the matmul rate of the dtype the products run in)."""
    gbs, gflops = roofs["bandwidth_gbs"], roofs["matmul_gflops"][compute]
    out = {}
    for side in ("posttrain", "llamacpp"):
        out[side] = {
            "batch1_of_bandwidth": round(report["batch1"][side] * weight_bytes / 1e9 / gbs, 3),
            **{
                f"{w}_of_matmul": round(report[w][side] * 2 * parameters / 1e9 / gflops, 3)
                for w in ("shared", "distinct")
            },
        }
    return {"weight_bytes": weight_bytes, "parameters": parameters, "matmul_dtype": compute, **out}


def measure_roofs(threads: int) -> dict:
    import roofs

    return {
        "bandwidth_gbs": roofs.memory_bandwidth_gbs(threads),
        "matmul_gflops": {dtype: roofs.matmul_gflops(dtype, threads) for dtype in ("float32", "bfloat16")},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llamacpp", type=Path, default=None, help="build_llamacpp.sh's DEST (bin/, GGUFs)")
    parser.add_argument("--hf-dir", type=Path, default=None, help="posttrain's HF export of the model")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {PRECISIONS}")
    parser.add_argument("--threads", type=int, default=2, help="threads on both sides (default: 2)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}, not {FULL}")
    parser.add_argument("--sequences", type=int, default=None, help="S of the batched workloads (default: 256)")
    parser.add_argument("--max-tokens", type=int, default=None, help="T, tokens decoded a sequence (default: 128)")
    parser.add_argument(
        "--speculative", type=int, default=0, metavar="K", help="also posttrain's batch 1 with K n-gram drafts"
    )
    parser.add_argument("--rounds", type=int, default=2, metavar="R", help="alternated rounds (default: 2)")
    parser.add_argument("--no-tune", action="store_true", help="llama.cpp's defaults (matched KV), no search")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as the JSON line; run nothing")
    args = parser.parse_args(argv)
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown or not args.precisions:
        parser.error(f"--precisions: {','.join(unknown) or 'none given'} (choose from {', '.join(PRECISIONS)})")
    for name in ("threads", "rounds", "sequences", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}: must be a positive integer")
    if args.speculative < 0:
        parser.error(f"--speculative={args.speculative}: a number of draft tokens >= 1, or 0 for off")
    base = QUICK if args.quick else FULL
    args.workload = Workload(
        sequences=args.sequences or base.sequences,
        max_tokens=args.max_tokens or base.max_tokens,
        repetitions=base.repetitions,
    )
    if args.workload.sequences > MAX_PARALLEL:
        parser.error(f"--sequences={args.workload.sequences}: llama.cpp runs at most {MAX_PARALLEL} in parallel")
    if not args.dry_run and args.llamacpp is None:
        parser.error("--llamacpp DIR is needed (build_llamacpp.sh's DEST), or --dry-run")
    if args.llamacpp is not None and not args.dry_run:
        for tool in ("llama-batched-bench", "llama-bench"):
            if not (args.llamacpp / "bin" / tool).exists():
                parser.error(f"--llamacpp {args.llamacpp}: no bin/{tool} there (run benchmarks/build_llamacpp.sh)")
    if args.hf_dir is None and not args.dry_run:
        parser.error("--hf-dir is needed: posttrain's HF export of the model (posttrain convert --out DIR)")
    return args


def plan(args: argparse.Namespace) -> dict:
    llamacpp = args.llamacpp or Path("LLAMACPP")
    report: dict = {"threads": args.threads, "workload": asdict(args.workload), "prompt_tokens": PROMPT_TOKENS}
    report["commands"] = {}
    for precision in args.precisions:
        defaults = LlamaSettings(kv_type=kv_type(precision))
        gguf = gguf_path(llamacpp, precision)
        common = dict(sequences=args.workload.sequences, max_tokens=args.workload.max_tokens)
        report["commands"][precision] = {
            "shared": batched_bench_command(
                llamacpp,
                gguf,
                **common,
                prompt_tokens=PROMPT_TOKENS,
                shared=True,
                threads=args.threads,
                settings=defaults,
            ),
            "distinct": batched_bench_command(
                llamacpp,
                gguf,
                **common,
                prompt_tokens=PROMPT_TOKENS,
                shared=False,
                threads=args.threads,
                settings=defaults,
            ),
            "batch1": batch1_plan(llamacpp, gguf, args, defaults),
            "tuning": {}
            if args.no_tune
            else {
                "batch1_grid": [s.label() for s in settings_grid(defaults.kv_type, batched=False)],
                "batched": "batch 1's fastest repack / pinning, flash attention off and on (x kv_unified: shared)",
                "workload": asdict(TUNE),
            },
        }
    return report


def batch1_plan(llamacpp: Path, gguf: Path, args: argparse.Namespace, settings: LlamaSettings) -> list[str]:
    """The batch-1 command LlamaCppSide.batch1 runs at `settings` (llama-bench, or batched-bench for f32 KV)."""
    if settings.kv_type in LLAMA_BENCH_KV_TYPES:
        return llama_bench_command(
            llamacpp,
            gguf,
            max_tokens=args.workload.max_tokens,
            depth=PROMPT_TOKENS,
            repetitions=args.workload.repetitions,
            threads=args.threads,
            grid=[settings],
        )
    return batched_bench_command(
        llamacpp,
        gguf,
        sequences=1,
        max_tokens=args.workload.max_tokens,
        prompt_tokens=PROMPT_TOKENS,
        shared=False,
        threads=args.threads,
        settings=settings,
        runs=args.workload.repetitions + 1,
    )


def run_precision(args: argparse.Namespace, precision: str) -> dict:
    if not gguf_path(args.llamacpp, precision).exists():
        convert(args.llamacpp, args.hf_dir, precision)
    theirs = LlamaCppSide(args.llamacpp, precision, args.threads)
    kv = kv_type(precision)
    if args.no_tune:
        best, tuning = {w: LlamaSettings(kv_type=kv) for w in WORKLOADS}, {}
    else:
        log(f"llama.cpp {precision}: trying its settings ({TUNE}) ...")
        best, tuning = theirs.tune(kv)
    log(f"posttrain {precision}: loading ...")
    ours = PosttrainSide(str(args.hf_dir), precision, args.workload, args.speculative)
    sides = {"llama.cpp": lambda: theirs.measure(args.workload, best), "posttrain": lambda: ours.measure(args.workload)}
    rounds = []
    for index in range(args.rounds):
        figures = {}
        for side in round_order(list(sides), index):
            log(f"{side} {precision} (round {index + 1} of {args.rounds}) ...")
            figures[side] = sides[side]()
            log(f"  { {k: v for k, v in figures[side].items() if k in WORKLOADS} }")
        rounds.append((figures["llama.cpp"], figures["posttrain"]))
    report = summarize(rounds)
    greedy = [ours_round["greedy"] for _, ours_round in rounds]
    report["posttrain_settings"] = {**ours.settings(), **ours.variants(args.workload, greedy[0])}
    report["posttrain_settings"]["greedy_identical_across_rounds"] = all(g == greedy[0] for g in greedy)
    report["llamacpp_settings"] = {w: asdict(s) for w, s in best.items()}
    report["llamacpp_batch1_tool"] = rounds[0][0]["batch1_tool"]
    report["tuning"] = tuning
    report["gguf_bytes"] = gguf_path(args.llamacpp, precision).stat().st_size
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(plan(args)))
        return 0
    import torch
    from provenance import environment

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    report: dict = {"threads": args.threads, "workload": asdict(args.workload), "prompt_tokens": PROMPT_TOKENS}
    report["llamacpp_version"] = version_info(args.llamacpp)
    report["environment"] = environment()
    log("roofs ...")
    report["roofs"] = measure_roofs(args.threads)
    log(f"  {report['roofs']}")
    parameters = parameter_count(args.hf_dir)
    for precision in args.precisions:
        report[precision] = run_precision(args, precision)
        compute = report[precision]["posttrain_settings"]["compute_dtype"]
        report[precision]["of_roof"] = roof_fractions(
            report[precision], report["roofs"], report[precision]["gguf_bytes"], parameters, compute
        )
    report["roofs_after"] = measure_roofs(args.threads)  # the machine's speed at the end: did it drift?
    print(json.dumps(report))
    return 0


def parameter_count(hf_dir: Path) -> int:
    """The export's parameters, from the safetensors headers (nothing loaded)."""
    import math

    from safetensors import safe_open

    total = 0
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


if __name__ == "__main__":
    sys.exit(main())

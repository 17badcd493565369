"""posttrain's engine against llama.cpp on this CPU, side by side in one run, at matching precision.

    bash benchmarks/build_llamacpp.sh /tmp/llamacpp HF_DIR    # once: llama.cpp's tools + GGUFs of HF_DIR
    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp /tmp/llamacpp --hf-dir HF_DIR
    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp /tmp/llamacpp --hf-dir HF_DIR --quick   # a smoke run
    .venv/bin/python benchmarks/vs_llamacpp.py --dry-run      # the plan (commands, workloads), nothing run

HF_DIR is posttrain's own export of the model (`posttrain convert --out HF_DIR`); both sides run those weights.
The GGUFs are DIR/smollm2-{f32,bf16,q8_0}.gguf as the build script writes them; a missing one is converted
from HF_DIR with DIR/convert_hf_to_gguf.py.

Two workloads, the same threads (--threads, 2 by default) on both sides, warm-up excluded on both:
- batched: llama.cpp's `llama-batched-bench -npp 95 -ntg T -npl 1,S -pps` (S parallel sequences sharing one
  95-token prompt, T new tokens each; its decode tokens/s, S_TG); posttrain's engine on P GSM8K prompts
  (examples/data) x n samples x T tokens at temperature 1, EOS ignored (S = P x n).
- batch 1: llama.cpp's S_TG at one sequence (the same run's -npl 1); posttrain one prompt x T tokens greedy, with
  the engine's default chained decode steps (`decode_steps` in the JSON) and again one step at a time
  (`batch1_one_step`, `one_step_identical`: the same tokens).
Both sides count decode only: S_TG leaves out the prompt's processing, and posttrain's figure is the tokens after
each sequence's first over their time (a run with max_tokens=1, the prefill and the first token, is timed apart
and taken out; `decode_rate`).

Precisions: llama.cpp F32 against posttrain fp32, BF16 against posttrain's fp32 weights at `compute_dtype="auto"`
(fp32 on a CPU without fast bf16, bf16 where it is fast: the JSON names it), Q8_0 against posttrain with
`quant="q8_0"` (the decoder and the LM head in int8, as the Q8_0 file rounds both).
`--speculative K` also runs posttrain's batch 1 with prompt-lookup (n-gram) drafts of K tokens on the same module
(`batch1_speculative`, its acceptance rate, and `batch1_speculative_ratio` against llama.cpp's plain batch 1).
`--rounds R` measures each precision R times, the sides alternating (llama.cpp then posttrain in odd rounds,
posttrain then llama.cpp in even ones): on a machine whose speed drifts between minutes, a ratio from one pair of
runs says as much about the minute as about the engines. Each figure is then the median over the rounds, each
ratio the median of the rounds' own ratios, and `rounds` lists every round's figures.
Prints progress to stderr and one JSON object as the last line of stdout: per precision both sides' figures and
`batched_ratio`, `batch1_ratio` (posttrain / llama.cpp; above 1: posttrain is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"
PRECISIONS = ("f32", "bf16", "q8_0")
PROMPT_TOKENS = 95  # llama-batched-bench's -npp, the length of a chat-templated GSM8K question
MAX_PARALLEL = 256  # llama.cpp's limit on parallel sequences


@dataclass(frozen=True)
class Workload:
    prompts: int  # posttrain: distinct prompts; llama.cpp: S = prompts x n sequences on one shared prompt
    n: int
    max_tokens: int

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


FULL = Workload(prompts=32, n=8, max_tokens=128)
QUICK = Workload(prompts=4, n=4, max_tokens=32)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gguf_path(llamacpp: Path, precision: str) -> Path:
    return llamacpp / f"smollm2-{precision}.gguf"


def batched_bench_command(llamacpp: Path, precision: str, workload: Workload, threads: int) -> list[str]:
    context = PROMPT_TOKENS + workload.sequences * workload.max_tokens + 1024  # -pps: the prompt is shared
    return [
        str(llamacpp / "bin" / "llama-batched-bench"),
        *("-m", str(gguf_path(llamacpp, precision)), "-c", str(context), "-b", "2048", "-ub", "512"),
        *("-npp", str(PROMPT_TOKENS), "-ntg", str(workload.max_tokens), "-npl", f"1,{workload.sequences}", "-pps"),
        *("-t", str(threads), "-tb", str(threads)),
    ]


def convert_command(llamacpp: Path, hf_dir: Path, precision: str) -> list[str]:
    return [
        sys.executable,
        str(llamacpp / "convert_hf_to_gguf.py"),
        str(hf_dir),
        *("--outtype", precision, "--outfile", str(gguf_path(llamacpp, precision))),
    ]


# One row of llama-batched-bench's table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
ROW = re.compile(r"^\|\s*" + r"\s*\|\s*".join([r"(\d+)"] * 4 + [r"([\d.]+)"] * 6) + r"\s*\|")


def parse_batched_bench(output: str) -> dict[int, float]:
    """Decode tokens/s (S_TG) by number of parallel sequences, from llama-batched-bench's table."""
    speeds = {}
    for line in output.splitlines():
        match = ROW.match(line.strip())
        if match:
            speeds[int(match.group(3))] = float(match.group(8))
    return speeds


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


def run_llamacpp(llamacpp: Path, hf_dir: Path | None, precision: str, workload: Workload, threads: int) -> dict:
    if not gguf_path(llamacpp, precision).exists():
        if hf_dir is None:
            sys.exit(f"error: {gguf_path(llamacpp, precision)} is missing: pass --hf-dir to convert it")
        convert(llamacpp, hf_dir, precision)
    command = batched_bench_command(llamacpp, precision, workload, threads)
    env = {**os.environ, "LD_LIBRARY_PATH": str(llamacpp / "bin")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    speeds = parse_batched_bench(done.stdout)
    if done.returncode != 0 or 1 not in speeds or workload.sequences not in speeds:
        sys.exit(f"error: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return {"batched": speeds[workload.sequences], "batch1": speeds[1]}


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    with open(GSM8K) as f:
        questions = [json.loads(line)["question"] for line, _ in zip(f, range(count))]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]


def run_posttrain(hf_dir: str, precision: str, workload: Workload, speculative: int = 0) -> dict:
    from posttrain.engine import LLM, SamplingParams

    # fp32 weights everywhere (what `LLM(model)` loads on CPU); BF16 runs the engine's compute_dtype=auto over
    # them, as a user gets it: bf16 weight copies and a bf16 KV pool on a CPU with fast bf16, fp32 elsewhere.
    dtype, compute = "float32", ("auto" if precision == "bf16" else "float32")
    quant = "q8_0" if precision == "q8_0" else None
    blocks = -(-workload.sequences * (PROMPT_TOKENS * 3 + workload.max_tokens) // 16)  # prompts up to ~3x -npp
    llm = LLM(
        hf_dir,
        dtype=dtype,
        compute_dtype=compute,
        quant=quant,
        num_kv_blocks=blocks,
        max_num_seqs=max(workload.sequences, 1),
    )
    llm.engine.touch_kv_cache()  # the pool's pages faulted in now (llama.cpp clears its cache at start too)
    prompts = load_prompts(llm.tokenizer, workload.prompts)
    llm.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, ignore_eos=True))  # warm-up
    sampled = SamplingParams(n=workload.n, temperature=1.0, max_tokens=workload.max_tokens, ignore_eos=True)
    batched, _ = decode_rate(llm, prompts, sampled)
    greedy = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up at batch 1
    batch1, outputs = decode_rate(llm, prompts[:1], greedy)
    plain = outputs[0].outputs[0].token_ids
    computed = str(llm.engine.runner.compute_dtype).removeprefix("torch.")
    result = {"batched": batched, "batch1": batch1, "dtype": computed, "quant": quant}
    result["decode_steps"] = llm.engine.config.decode_steps
    result.update(one_step_batch1(llm, compute, prompts[0], greedy, plain))
    if speculative:
        result.update(speculative_batch1(llm, compute, prompts[0], greedy, speculative, plain))
    return result


def decode_rate(llm, prompts: list[list[int]], params) -> tuple[float, list]:  # noqa: ANN001 (LLM, SamplingParams)
    """Decode tokens/s as llama-batched-bench's S_TG counts them, and the outputs: the run with max_tokens=1 (the
    prompts' prefill and each sequence's first token, sampled from it) is timed too and taken out of the full run's
    time and tokens. Each run starts from an empty prefix cache."""
    runs = []
    for max_tokens in (1, params.max_tokens):
        llm.engine.weights_updated()  # an empty prefix cache: both runs prefill the prompts
        start = time.perf_counter()
        outputs = llm.generate(prompts, dataclasses.replace(params, max_tokens=max_tokens))
        runs.append((time.perf_counter() - start, sum(len(c.token_ids) for o in outputs for c in o.outputs)))
    (first_s, first_tokens), (all_s, all_tokens) = runs
    return (all_tokens - first_tokens) / (all_s - first_s), outputs


def batch1_engine(llm, compute: str, prompt: list[int], **fields):  # noqa: ANN001, ANN003, ANN201
    """Another batch-1 engine over `llm`'s (already quantized) module with EngineConfig `fields`, warmed up."""
    from posttrain.engine import LLM, SamplingParams

    engine_llm = LLM(llm.engine.model, llm.tokenizer, compute_dtype=compute, max_num_seqs=1, **fields)
    engine_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    return engine_llm


def one_step_batch1(chained_llm, compute: str, prompt: list[int], greedy, plain: list[int]) -> dict:  # noqa: ANN001
    """Batch 1 again one decode step at a time (EngineConfig.decode_steps=1: no chained decode steps) over the same
    module: what the chains bring, and whether the greedy output is the same (it must be)."""
    llm = batch1_engine(chained_llm, compute, prompt, decode_steps=1)
    rate, outputs = decode_rate(llm, [prompt], greedy)
    return {"batch1_one_step": rate, "one_step_identical": list(outputs[0].outputs[0].token_ids) == list(plain)}


def speculative_batch1(plain_llm, compute: str, prompt: list[int], greedy, num_tokens: int, plain: list[int]) -> dict:  # noqa: ANN001
    """Batch 1 again with prompt-lookup (n-gram) drafts of `num_tokens` over the same (already quantized) module:
    tokens/s, the acceptance rate, and whether the greedy output is the plain one (it must be)."""
    llm = batch1_engine(plain_llm, compute, prompt, speculative={"method": "ngram", "num_tokens": num_tokens})
    before = llm.engine.stats()
    rate, outputs = decode_rate(llm, [prompt], greedy)
    tokens = outputs[0].outputs[0].token_ids
    after = llm.engine.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {
        "batch1_speculative": rate,
        "speculative_acceptance": round(accepted / drafted, 3) if drafted else 0.0,
        "speculative_identical": list(tokens) == list(plain),
    }


def ratios(theirs: dict, ours: dict) -> dict:
    """posttrain / llama.cpp for each workload both sides measured (above 1: posttrain is faster)."""
    out = {"batched_ratio": ours["batched"] / theirs["batched"], "batch1_ratio": ours["batch1"] / theirs["batch1"]}
    if "batch1_speculative" in ours:
        out["batch1_speculative_ratio"] = ours["batch1_speculative"] / theirs["batch1"]
    return out


def summarize(rounds: list[tuple[dict, dict]]) -> dict:
    """One precision's report from its rounds of (llama.cpp's figures, posttrain's): each side's numeric figures
    as medians over the rounds, flags (`speculative_identical`) true only if true in every round, the rest (the
    dtype) from the first round; each ratio the median of the rounds' own ratios; with more than one round, every
    round's figures under `rounds`."""

    def combined(values: list) -> object:
        if isinstance(values[0], bool):
            return all(values)
        if isinstance(values[0], (int, float)):
            return statistics.median(values)
        return values[0]

    def medians(results: list[dict]) -> dict:
        return {key: combined([r[key] for r in results]) for key in results[0]}

    per_round = [ratios(theirs, ours) for theirs, ours in rounds]
    report = {
        "llamacpp": medians([theirs for theirs, _ in rounds]),
        "posttrain": medians([ours for _, ours in rounds]),
        **{key: round(statistics.median(r[key] for r in per_round), 3) for key in per_round[0]},
    }
    if len(rounds) > 1:
        report["rounds"] = [
            {"llamacpp": theirs, "posttrain": ours, **{k: round(v, 3) for k, v in r.items()}}
            for (theirs, ours), r in zip(rounds, per_round)
        ]
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llamacpp", type=Path, default=None, help="build-llamacpp.sh's DEST (bin/, GGUFs)")
    parser.add_argument("--hf-dir", type=Path, default=None, help="posttrain's HF export of the model")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {PRECISIONS}")
    parser.add_argument("--threads", type=int, default=2, help="threads on both sides (default: 2)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}, not {FULL}")
    parser.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="also posttrain's batch 1 with n-gram speculative decoding, K drafts a step (default: off)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="measure each precision R times, the two sides alternating; report medians (default: 1)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan as the JSON line; run nothing")
    args = parser.parse_args(argv)
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown or not args.precisions:
        parser.error(f"--precisions: {','.join(unknown) or 'none given'} (choose from {', '.join(PRECISIONS)})")
    if args.speculative < 0:
        parser.error(f"--speculative={args.speculative}: a number of draft tokens >= 1, or 0 for off")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: must be a positive integer")
    if args.threads < 1:
        parser.error(f"--threads={args.threads}: must be a positive integer")
    if not args.dry_run and args.llamacpp is None:
        parser.error("--llamacpp DIR is needed (build-llamacpp.sh's DEST), or --dry-run")
    if args.llamacpp is not None and not args.dry_run and not (args.llamacpp / "bin" / "llama-batched-bench").exists():
        parser.error(f"--llamacpp {args.llamacpp}: no bin/llama-batched-bench there (run build-llamacpp.sh)")
    if args.hf_dir is None and not args.dry_run:
        parser.error("--hf-dir is needed: posttrain's HF export of the model (posttrain convert --out DIR)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = QUICK if args.quick else FULL
    if workload.sequences > MAX_PARALLEL:
        sys.exit(f"error: {workload.sequences} sequences: llama.cpp runs at most {MAX_PARALLEL} in parallel")
    llamacpp = args.llamacpp or Path("LLAMACPP")
    report: dict = {"threads": args.threads, "workload": asdict(workload), "prompt_tokens": PROMPT_TOKENS}
    if args.dry_run:
        report["commands"] = {p: batched_bench_command(llamacpp, p, workload, args.threads) for p in args.precisions}
        print(json.dumps(report))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    for precision in args.precisions:
        sides = {
            "llama.cpp": functools.partial(run_llamacpp, llamacpp, args.hf_dir, precision, workload, args.threads),
            "posttrain": functools.partial(run_posttrain, str(args.hf_dir), precision, workload, args.speculative),
        }
        rounds = []
        for number in range(1, args.rounds + 1):
            order = list(sides) if number % 2 else list(reversed(sides))  # even rounds: posttrain first
            figures = {}
            for side in order:
                log(f"{side} {precision} (round {number} of {args.rounds}) ...")
                figures[side] = sides[side]()
                log(f"  {figures[side]}")
            rounds.append((figures["llama.cpp"], figures["posttrain"]))
        report[precision] = summarize(rounds)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

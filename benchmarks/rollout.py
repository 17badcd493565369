"""Rollout throughput: posttrain's engine against transformers `generate`, same model, same prompts, one run.

    .venv/bin/python benchmarks/rollout.py                    # 64 prompts x n=8 x 32 new tokens
    .venv/bin/python benchmarks/rollout.py --max-tokens 128
    .venv/bin/python benchmarks/rollout.py --device cuda --cuda-graphs    # bf16 on a GPU (benchmarks/gpu_check.sh)
    .venv/bin/python benchmarks/rollout.py --max-tokens 128 --compute-dtype float32,bfloat16 --hf-prompts 0
        # the engine in fp32 and then in bf16 over the same fp32 weights: `bf16_over_fp32` is the tokens/s ratio

Prompts: GSM8K train questions through the model's chat template. Sampling at temperature 1 with EOS
ignored, so every sample is exactly --max-tokens long. transformers runs the same prompts (all of them by
default; --hf-prompts K takes the first K for a quicker, rougher figure) and the two are compared in generated
tokens/s. The sides alternate, engine then transformers, then the other way round, --rounds times (each side's
model loaded and warmed up once, before the first round); the JSON gives the medians and the spread of the
per-round ratios (`speedup` is the median; benchmarks/alternation.py).

Precision is the same on both sides: --precision fp32 (the default on CPU) runs the engine with
`compute_dtype=float32` over fp32 weights and transformers in fp32; --precision bf16 (the default on CUDA) runs
the engine with `compute_dtype=bfloat16` (bf16 compute over the fp32 weights a trainer holds, on CPU; bf16
weights on CUDA) and transformers with bf16 weights. --compute-dtype overrides the engine's side only, one run
per comma-separated value, each reported in `posttrain_runs` under the dtype it resolved to (`posttrain` is the
first run; `bf16_over_fp32` the tokens/s ratio where both ran); `sides` names what each side computed in.

Roofs (CPU): the memory bandwidth and matmul GFLOP/s of benchmarks/roofs.py are measured in the same run, and
each figure is reported as a fraction of the roof that bounds it (`roof_fractions`): batch-1 decode (one prompt,
one sample, --max-tokens tokens; the engine in its compute dtype) against the bandwidth, as each token streams
every weight once (parameters x the compute dtype's bytes); the batched run against the matmul rate in its
compute dtype, counting 2 x parameters FLOP per token through the model (prefill + decode; prefix-cache hits
excluded). On CUDA the matmul rate is timed on the device and the bandwidth is not probed.
The engine's allocator tuning (EngineConfig.tune_cpu_allocator) is process-wide, so transformers runs
after it with the same tuned allocator: the ratio compares the engines, not malloc settings.
Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import roofs  # noqa: E402
from alternation import alternate, ratio_summary  # noqa: E402
from provenance import environment, package_versions, torch_dtype_name  # noqa: E402

from posttrain.engine import LLM, SamplingParams  # noqa: E402
from posttrain.models.hub import load_model, resolve_model_path  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def matmul_gflops(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_prompts(path: Path, count: int, tokenizer) -> list[list[int]]:
    questions = []
    with open(path) as f:
        for line in f:
            questions.append(json.loads(line)["question"])
            if len(questions) == count:
                break
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]


class EngineSide:
    """The engine over `model`, its KV pool faulted in and warmed up once; each call is one measured generate."""

    def __init__(self, model, tokenizer, prompts, n: int, max_tokens: int, params_count: int, **engine) -> None:
        self.llm = LLM(model, tokenizer, **engine)
        self.llm.engine.touch_kv_cache()  # the pool's pages faulted in now, not in the measured run
        self.prompts, self.params_count = prompts, params_count
        self.params = SamplingParams(
            n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True, seed=None
        )
        self.llm.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, ignore_eos=True))  # warm-up
        self.last: dict = {}

    def __call__(self) -> float:
        """Generated tokens/s of one run over all prompts, from an empty prefix cache (as an RL step starts)."""
        llm = self.llm
        llm.weights_updated()
        before = llm.stats()
        start = time.perf_counter()
        outputs = llm.generate(self.prompts, self.params)
        seconds = time.perf_counter() - start
        after = llm.stats()
        generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        processed = after["processed_tokens"] - before["processed_tokens"]
        self.last = {
            "seconds": round(seconds, 2),
            "generated_tokens": generated,
            "tokens_per_s": round(generated / seconds, 1),
            "processed_tokens": processed,
            "steps": after["steps"] - before["steps"],
            "preemptions": after["preemptions"] - before["preemptions"],
            "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
            "model_gflops": round(2 * self.params_count * processed / seconds / 1e9, 1),
            "kv_blocks": after["kv_blocks"],
            "attention_backend": llm.engine.attention_backend,
            "compute_dtype": torch_dtype_name(llm.compute_dtype),
        }
        return generated / seconds


class TransformersSide:
    """transformers `generate` over the same prompts, left-padded, loaded and warmed up once."""

    def __init__(self, model_dir: Path, prompts, n: int, max_tokens: int, pad_id: int, device, dtype) -> None:  # noqa: ANN001
        import transformers

        transformers.logging.set_verbosity_error()
        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.width = max(len(p) for p in prompts)
        self.input_ids = torch.tensor([[pad_id] * (self.width - len(p)) + p for p in prompts], device=device)
        self.attention_mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in prompts], device=device)
        self.kwargs = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
        )
        with torch.inference_mode():
            self.model.generate(
                input_ids=self.input_ids[:1],
                attention_mask=self.attention_mask[:1],
                **{**self.kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
            )
        self.last: dict = {}

    def __call__(self) -> float:
        with torch.inference_mode():
            synchronize(self.device)
            start = time.perf_counter()
            out = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention_mask, **self.kwargs)
            synchronize(self.device)
            seconds = time.perf_counter() - start
        generated = (out.shape[1] - self.width) * out.shape[0]
        self.last = {"seconds": round(seconds, 2), "generated_tokens": generated}
        return generated / seconds


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_dtypes(precision: str, device: torch.device) -> tuple[torch.dtype, str, torch.dtype]:
    """(weights dtype for the engine's model, engine compute_dtype, transformers' dtype) for `precision`.

    On CPU the engine's weights stay fp32 (a trainer's weights) and bf16 is its compute dtype over them; on an
    accelerator the weights themselves are bf16, as the engine loads them there."""
    compute = PRECISION_DTYPES[precision]
    weights = compute if device.type != "cpu" else torch.float32
    return weights, torch_dtype_name(compute), compute


def roof_fractions(batch1_tok_s: float, params_count: int, compute: str, batched_gflops: float, roof: dict) -> dict:
    """Batch-1 decode as a fraction of the bandwidth roof (every weight streamed once per token, in the compute
    dtype's bytes) and the batched run's model GFLOP/s as a fraction of the matmul roof in the compute dtype."""
    weight_bytes = params_count * torch.empty((), dtype=getattr(torch, compute)).element_size()
    fractions: dict[str, object] = {"batch1_weight_bytes": weight_bytes}
    if roof.get("bandwidth_gbs"):
        streamed = batch1_tok_s * weight_bytes / 1e9
        fractions["batch1_streamed_gbs"] = round(streamed, 2)
        fractions["batch1_of_bandwidth"] = round(streamed / roof["bandwidth_gbs"], 3)
    fractions["batched_of_matmul"] = round(batched_gflops / roof["matmul_gflops"][compute], 3)
    return fractions


def measure_roofs(device: torch.device, dtypes: set[str]) -> dict:
    """benchmarks/roofs.py on CPU (at torch's threads); on an accelerator, the device's matmul rate only."""
    if device.type == "cpu":
        return roofs.measure(torch.get_num_threads())
    return {"matmul_gflops": {d: round(matmul_gflops(device, getattr(torch, d)), 1) for d in sorted(dtypes)}}


def batch1_decode(model, tokenizer, prompt: list[int], max_tokens: int, **engine) -> float:  # noqa: ANN001
    """Decode tokens/s of one prompt, one sample: (max_tokens - 1) tokens over the time they add to 1 token."""
    llm = LLM(model, tokenizer, **engine)
    greedy = lambda count: SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)  # noqa: E731
    llm.generate([prompt], greedy(4))  # warm-up
    best = float("inf")
    for _ in range(3):
        llm.weights_updated()
        start = time.perf_counter()
        llm.generate([prompt], greedy(1))
        first = time.perf_counter() - start
        llm.weights_updated()
        start = time.perf_counter()
        llm.generate([prompt], greedy(max_tokens))
        best = min(best, time.perf_counter() - start - first)
    return (max_tokens - 1) / best


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--hf-prompts", type=int, default=None, help="prompts for the transformers side (default: all; 0: skip it)"
    )
    parser.add_argument("--data", type=Path, default=GSM8K)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (both sides)")
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISION_DTYPES),
        default=None,
        help="both sides (default: fp32 on CPU, bf16 else)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of both sides (>= 2)")
    parser.add_argument("--cuda-graphs", action="store_true", help="EngineConfig.cuda_graphs (CUDA only)")
    parser.add_argument("--attention-backend", default="auto", help="EngineConfig.attention_backend")
    parser.add_argument(
        "--compute-dtype",
        default=None,
        help="the engine's EngineConfig.compute_dtype instead of --precision's: auto | float32 | bfloat16, or several "
        "comma-separated, one engine run each (e.g. float32,bfloat16)",
    )
    parser.add_argument("--no-roofs", action="store_true", help="skip the roof probes and the batch-1 run")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (each side goes first at least once)")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (batch-1 decode counts the tokens after the first)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.hf_prompts is None:
        args.hf_prompts = args.prompts

    torch.manual_seed(0)
    device = torch.device(args.device)
    precision = args.precision or ("fp32" if device.type == "cpu" else "bf16")
    dtype, compute_default, hf_dtype = precision_dtypes(precision, device)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    prompts = load_prompts(args.data, args.prompts, tokenizer)
    params_count = model.num_parameters()
    compute_dtypes = [c.strip() for c in (args.compute_dtype or compute_default).split(",")]
    engine_options = dict(cuda_graphs=args.cuda_graphs, attention_backend=args.attention_backend)
    sides = {}
    for compute_dtype in compute_dtypes:
        side = EngineSide(
            model, tokenizer, prompts, args.n, args.max_tokens, params_count, compute_dtype=compute_dtype,
            **engine_options,
        )  # fmt: skip
        sides[f"posttrain {torch_dtype_name(side.llm.compute_dtype)}"] = side
    if args.hf_prompts:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        hf_prompts = prompts[: args.hf_prompts]
        sides["transformers"] = TransformersSide(
            resolve_model_path(args.model), hf_prompts, args.n, args.max_tokens, pad_id, device, hf_dtype
        )
    rates = alternate(sides, args.rounds)
    runs = {}
    for name, side in sides.items():
        if name == "transformers":
            continue
        run = dict(side.last, tokens_per_s=round(statistics.median(rates[name]), 1))
        run["rounds_tokens_per_s"] = [round(r, 1) for r in rates[name]]
        runs[run["compute_dtype"]] = run
        log(f"{name}: {run}")
    ours_name = next(iter(sides))
    ours = next(iter(runs.values()))
    result = {
        "benchmark": "rollout",
        "model": args.model,
        "precision": precision,
        "shape": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        },
        "device": str(device),
        "dtype": torch_dtype_name(dtype),
        "engine_compute_dtype": ours["compute_dtype"],
        "cuda_graphs": args.cuda_graphs,
        "threads": torch.get_num_threads(),
        "posttrain": ours,
    }
    if len(runs) > 1:
        result["posttrain_runs"] = runs
    if "float32" in runs and "bfloat16" in runs:
        bf16 = ratio_summary(rates["posttrain bfloat16"], rates["posttrain float32"])
        result["bf16_over_fp32"] = bf16["ratio_median"]
    threads = torch.get_num_threads()
    result["sides"] = {
        "posttrain": {
            "weights": torch_dtype_name(dtype),
            "compute": ours["compute_dtype"],
            "threads": threads,
            "versions": package_versions(("torch", "posttrain")),
        }
    }
    if "transformers" in sides:
        hf = dict(sides["transformers"].last, tokens_per_s=round(statistics.median(rates["transformers"]), 1))
        hf["rounds_tokens_per_s"] = [round(r, 1) for r in rates["transformers"]]
        hf["prompts"] = args.hf_prompts
        log(f"transformers: {hf}")
        result["transformers"] = hf
        summary = ratio_summary(rates[ours_name], rates["transformers"])
        result["speedup"] = summary["ratio_median"]
        result["speedup_min"], result["speedup_max"] = summary["ratio_min"], summary["ratio_max"]
        result["sides"]["transformers"] = {
            "weights": torch_dtype_name(hf_dtype),
            "compute": torch_dtype_name(hf_dtype),
            "threads": threads,
            "versions": package_versions(("torch", "transformers")),
        }
        result["note"] = (
            f"transformers ran on the first {args.hf_prompts} of the {args.prompts} prompts (same n "
            "and length); compared in generated tokens/s"
        )
    if not args.no_roofs:
        log("roofs ...")
        roof = measure_roofs(device, set(runs))
        result["roofs"] = roof
        compute = ours["compute_dtype"]
        result["matmul_gflops"] = roof["matmul_gflops"][compute]
        result["matmul_fraction"] = round(ours["model_gflops"] / roof["matmul_gflops"][compute], 3)
        for run in runs.values():
            run["matmul_fraction"] = round(run["model_gflops"] / roof["matmul_gflops"][run["compute_dtype"]], 3)
        batch1 = batch1_decode(model, tokenizer, prompts[0], args.max_tokens, compute_dtype=compute, **engine_options)
        result["batch1_decode_tok_s"] = round(batch1, 2)
        result["roof_fractions"] = roof_fractions(batch1, params_count, compute, ours["model_gflops"], roof)
    result["environment"] = environment()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

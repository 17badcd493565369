"""Rollout throughput: posttrain's engine against transformers `generate`, same model, same prompts, one run.

    .venv/bin/python benchmarks/rollout.py                    # 64 prompts x n=8 x 32 new tokens
    .venv/bin/python benchmarks/rollout.py --max-tokens 128
    .venv/bin/python benchmarks/rollout.py --device cuda --cuda-graphs    # bf16 on a GPU (benchmarks/gpu_check.sh)
    .venv/bin/python benchmarks/rollout.py --max-tokens 128 --compute-dtype float32,bfloat16 --hf-prompts 0
        # the engine in fp32 and then in bf16 over the same fp32 weights: `bf16_over_fp32` is the tokens/s ratio

Prompts: GSM8K train questions through the model's chat template. Sampling at temperature 1 with EOS
ignored, so every sample is exactly --max-tokens long. transformers runs the same prompts (all of them by
default; --hf-prompts K takes the first K for a quicker, rougher figure: at 128 tokens transformers made
154 tokens/s on 16 prompts and 128 on all 64) and the two are compared in generated tokens/s.
--dtype is the weights' dtype (both sides); --compute-dtype the engine's EngineConfig.compute_dtype (auto: bf16
over fp32 weights on a CPU with fast bf16, `posttrain info`), one run per comma-separated value, each reported in
`posttrain_runs` under the dtype it resolved to (`posttrain` is the first run; `engine_compute_dtype` its dtype).
Also reported: the fraction of this machine's matmul rate (in the engine's compute dtype, on its device) it
reaches, counting 2 x parameters FLOP per token through the model (prefill + decode; prefix-cache hits
excluded).
The engine's allocator tuning (EngineConfig.tune_cpu_allocator) is process-wide, so transformers runs
after it with the same tuned allocator: the ratio compares the engines, not malloc settings.
Prints progress to stderr and one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.engine import LLM, SamplingParams  # noqa: E402
from posttrain.models.checkpoint_io import parse_dtype  # noqa: E402
from posttrain.models.hub import default_dtype, load_model, resolve_model_path  # noqa: E402

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


def run_posttrain(model, tokenizer, prompts, n: int, max_tokens: int, params_count: int, **engine) -> dict:
    llm = LLM(model, tokenizer, **engine)
    llm.engine.touch_kv_cache()  # the pool's pages faulted in now, not in the measured run
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True, seed=None)
    llm.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, ignore_eos=True))  # warm-up
    llm.weights_updated()  # an empty prefix cache, as at the start of an RL step
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.stats()
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    processed = after["processed_tokens"] - before["processed_tokens"]
    return {
        "seconds": round(seconds, 2),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / seconds, 1),
        "processed_tokens": processed,
        "steps": after["steps"] - before["steps"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        "model_gflops": round(2 * params_count * processed / seconds / 1e9, 1),
        "kv_blocks": after["kv_blocks"],
        "attention_backend": llm.engine.attention_backend,
        "compute_dtype": str(llm.compute_dtype).removeprefix("torch."),
    }


def run_transformers(
    model_dir: Path, prompts, n: int, max_tokens: int, pad_id: int, device: torch.device, dtype: torch.dtype
) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(
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
        model.generate(
            input_ids=input_ids[:1],
            attention_mask=attention_mask[:1],
            **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
        )
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - start
    generated = (out.shape[1] - width) * out.shape[0]
    return {"seconds": round(seconds, 2), "generated_tokens": generated, "tokens_per_s": round(generated / seconds, 1)}


def main() -> None:
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
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 else)")
    parser.add_argument("--cuda-graphs", action="store_true", help="EngineConfig.cuda_graphs (CUDA only)")
    parser.add_argument("--attention-backend", default="auto", help="EngineConfig.attention_backend")
    parser.add_argument(
        "--compute-dtype",
        default="auto",
        help="EngineConfig.compute_dtype: auto | float32 | bfloat16, or several comma-separated, one engine run each "
        "(e.g. float32,bfloat16; default: auto)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.hf_prompts is None:
        args.hf_prompts = args.prompts

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = parse_dtype(args.dtype) or default_dtype(device)
    gflops = {dtype: matmul_gflops(device, dtype)}
    log(f"{dtype} matmul on {device}: {gflops[dtype]:.0f} GFLOP/s")
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    prompts = load_prompts(args.data, args.prompts, tokenizer)
    params_count = model.num_parameters()
    runs = {}
    for compute_dtype in args.compute_dtype.split(","):
        engine = dict(
            cuda_graphs=args.cuda_graphs, attention_backend=args.attention_backend, compute_dtype=compute_dtype.strip()
        )
        run = run_posttrain(model, tokenizer, prompts, args.n, args.max_tokens, params_count, **engine)
        run_dtype = parse_dtype(run["compute_dtype"])
        if run_dtype not in gflops:
            gflops[run_dtype] = matmul_gflops(device, run_dtype)
            log(f"{run_dtype} matmul on {device}: {gflops[run_dtype]:.0f} GFLOP/s")
        run["matmul_gflops"] = round(gflops[run_dtype], 1)
        run["matmul_fraction"] = round(run["model_gflops"] / gflops[run_dtype], 3)
        log(f"posttrain ({run['compute_dtype']}): {run}")
        runs[run["compute_dtype"]] = run
    ours = next(iter(runs.values()))
    result = {
        "benchmark": "rollout",
        "model": args.model,
        "shape": {
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        },
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "engine_compute_dtype": ours["compute_dtype"],
        "cuda_graphs": args.cuda_graphs,
        "threads": torch.get_num_threads(),
        "matmul_gflops": round(gflops[dtype], 1),
        "posttrain": ours,
    }
    if len(runs) > 1:
        result["posttrain_runs"] = runs
    if "float32" in runs and "bfloat16" in runs:
        result["bf16_over_fp32"] = round(runs["bfloat16"]["tokens_per_s"] / runs["float32"]["tokens_per_s"], 2)
    if args.hf_prompts:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        hf = run_transformers(
            resolve_model_path(args.model), prompts[: args.hf_prompts], args.n, args.max_tokens, pad_id, device, dtype
        )
        hf["prompts"] = args.hf_prompts
        log(f"transformers: {hf}")
        result["transformers"] = hf
        result["speedup"] = round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)
        result["note"] = (
            f"transformers ran on the first {args.hf_prompts} of the {args.prompts} prompts (same n "
            "and length); compared in generated tokens/s"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

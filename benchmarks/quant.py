"""Decode speed and weight memory of each quantization scheme against fp32, one run, one JSON line.

    .venv/bin/python benchmarks/quant.py                          # all schemes, 8 prompts, 32 new tokens
    .venv/bin/python benchmarks/quant.py --schemes int8 int4-g128 --batch 4 --max-tokens 16 --rounds 2
    .venv/bin/python benchmarks/quant.py --schemes --inference int8 q8_0 --batch 1 --max-tokens 128   # --quant
    .venv/bin/python benchmarks/quant.py --schemes int8 --compute-dtype bfloat16      # baseline: bf16 compute

Every variant is the same fp32 model (default: the embedded SmolLM2-135M) quantized in memory, served by the
rollout engine (`posttrain.engine.LLM` over the live module, greedy, EOS ignored, prefix cache off), or with
--runner loop by a plain batched greedy loop that calls `model(ids)` on the whole sequence each step.
The baseline `fp32` computes in fp32: the engine runs with --compute-dtype float32 (the default here; the
engine's own default `auto` would compute the fp32 weights in bf16 on a CPU with fast bf16). --compute-dtype
bfloat16 or auto gives every variant that engine setting instead, and the baseline is then named for what it
computes (`fp32 weights, bfloat16 compute`); the JSON names each variant's resolved compute dtype.

Decode tokens/s isolates the decode steps: each round generates 1 token and then --max-tokens tokens from
the same prompts, and decode rate = batch x (max_tokens - 1) / (t(max_tokens) - t(1)). Variants run
interleaved, round after round, in reversed order every other round (benchmarks/alternation.py); each variant
reports its median rate and the median, min and max of its per-round ratio to the baseline (the machine is
shared and noisy: quote the ratios). Besides the schemes (default kernels, see posttrain/quant/linear.py), two variants of
int4-g128 show the alternatives measured for the forward: `/reference` dequantizes the weight on every
call, `/cached-fp32` keeps the dequantized fp32 weight resident (fp32 speed at fp32 memory).
--inference adds the inference commands' `--quant` modes (posttrain/quant/inference.py: q8_0 rounds the LM head
and the activations too), as `LLM(model, quant=...)` loads them.
`weights_bytes` counts every tensor the model holds (parameters, buffers, kernel caches; tied weights once);
`greedy_match` is the fraction of generated tokens equal to fp32's, up to each sample's first difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from alternation import alternate, ratio_summary
from provenance import environment

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.models.hub import load_model  # noqa: E402
from posttrain.quant import SCHEMES, QuantizedLinear, dequantize_model, quantize_model, set_compute  # noqa: E402
from posttrain.quant.inference import INFERENCE_SCHEMES, quantize_for_inference  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of all distinct storages the model holds, including QuantizedLinear's kernel caches."""
    seen: dict[int, int] = {}
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors += [t for t in module._kernel_cache.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    questions = []
    with open(GSM8K) as f:
        for line in f:
            questions.append(json.loads(line)["question"])
            if len(questions) == count:
                break
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]


class EngineRunner:
    def __init__(self, model, tokenizer, prompts: list[list[int]], max_tokens: int, compute_dtype: str) -> None:
        from posttrain.engine import LLM, SamplingParams

        blocks = len(prompts) * (-(-(max(map(len, prompts)) + max_tokens) // 16) + 1) + 8
        self.llm = LLM(model, tokenizer, num_kv_blocks=blocks, enable_prefix_caching=False, compute_dtype=compute_dtype)
        self.prompts = prompts
        self.params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        self.compute = str(self.llm.compute_dtype).removeprefix("torch.")

    def generate(self, max_tokens: int) -> list[list[int]]:
        outputs = self.llm.generate(self.prompts, self.params(max_tokens))
        return [o.outputs[0].token_ids for o in outputs]


class LoopRunner:
    """Batched greedy decoding without a KV cache: left-padded prompts, `model(ids)` over everything each step."""

    def __init__(self, model, tokenizer, prompts: list[list[int]], max_tokens: int, compute_dtype: str) -> None:
        self.model, self.prompts = model, prompts
        self.compute = "float32"  # the module's own forward: fp32 weights and activations, no autocast

    @torch.no_grad()
    def generate(self, max_tokens: int) -> list[list[int]]:
        width = max(map(len, self.prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in self.prompts])  # (B, T)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in self.prompts])
        for _ in range(max_tokens):
            next_ids = self.model(ids, attention_mask=mask)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            ids, mask = torch.cat([ids, next_ids], 1), torch.cat([mask, torch.ones_like(next_ids)], 1)
        return ids[:, width:].tolist()


RUNNERS = {"engine": EngineRunner, "loop": LoopRunner}


def build_variants(model, schemes: list[str], inference: list[str]) -> dict[str, torch.nn.Module]:
    variants = {"fp32": model}
    for name in schemes:
        variants[name] = quantize_model(copy.deepcopy(model), name)
    for name in inference:
        variants[f"--quant {name}"] = quantize_for_inference(copy.deepcopy(model), name)
    if "int4-g128" in schemes:
        variants["int4-g128/reference"] = set_compute(quantize_model(copy.deepcopy(model), "int4-g128"), "reference")
        variants["int4-g128/cached-fp32"] = dequantize_model(quantize_model(copy.deepcopy(model), "int4-g128"))
    return variants


def greedy_match(tokens: list[list[int]], reference: list[list[int]]) -> float:
    same = 0
    for ours, theirs in zip(tokens, reference):
        for a, b in zip(ours, theirs):
            if a != b:
                break
            same += 1
    return same / sum(map(len, reference))


def baseline_name(compute: str) -> str:
    """The fp32 model's label: `fp32` where it computes in fp32, else named for what it computes."""
    return "fp32" if compute == "float32" else f"fp32 weights, {compute} compute"


def decode_rate(batch: int, max_tokens: int, seconds_one: float, seconds_all: float) -> float:
    """Decode tokens/s: the (max_tokens - 1) tokens after the first, over the time they added."""
    return batch * (max_tokens - 1) / (seconds_all - seconds_one)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--inference", nargs="*", default=[], choices=list(INFERENCE_SCHEMES), help="--quant modes")
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 2); medians over them")
    parser.add_argument("--runner", choices=list(RUNNERS), default="engine")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16", "auto"),
        default="float32",
        help="the engine's EngineConfig.compute_dtype for every variant (default float32: an fp32 baseline)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (each variant goes first and last at least once)")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (decode rate counts the tokens after the first)")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    prompts = load_prompts(tokenizer, args.batch)
    variants = build_variants(model, args.schemes, args.inference)
    runners = {
        name: RUNNERS[args.runner](m, tokenizer, prompts, args.max_tokens, args.compute_dtype)
        for name, m in variants.items()
    }
    tokens: dict[str, list[list[int]]] = {}
    for runner in runners.values():  # warm-up (and builds the kernels' caches)
        runner.generate(2)

    def measure(name: str):
        def once() -> float:
            runner = runners[name]
            start = time.perf_counter()
            runner.generate(1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            tokens[name] = runner.generate(args.max_tokens)
            return decode_rate(args.batch, args.max_tokens, first, first + time.perf_counter() - start)

        return once

    rates = alternate({name: measure(name) for name in variants}, args.rounds)
    fp32_bytes = tensor_bytes(variants["fp32"])
    baseline = baseline_name(runners["fp32"].compute)
    variant_figures = {}
    for name, m in variants.items():
        if name == "fp32":
            continue
        summary = ratio_summary(rates[name], rates["fp32"], higher_is_better=True)
        variant_figures[name] = {
            "decode_tok_s": summary["ours_median"],
            "ratio_vs_fp32": summary["ratio_median"],
            "ratio_min": summary["ratio_min"],
            "ratio_max": summary["ratio_max"],
            "rounds_tok_s": summary["ours_rounds"],
            "compute": runners[name].compute,
            "weights_bytes": tensor_bytes(m),
            "bytes_ratio_vs_fp32": round(tensor_bytes(m) / fp32_bytes, 3),
            "greedy_match": round(greedy_match(tokens[name], tokens["fp32"]), 3),
        }
    result = {
        "benchmark": "quant_decode",
        "model": args.model,
        "runner": args.runner,
        "batch": args.batch,
        "new_tokens": args.max_tokens,
        "rounds": args.rounds,
        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
        "threads": torch.get_num_threads(),
        "engine_compute_dtype": args.compute_dtype if args.runner == "engine" else None,
        "fp32": {
            "name": baseline,
            "weights": "float32",
            "compute": runners["fp32"].compute,
            "decode_tok_s": round(statistics.median(rates["fp32"]), 3),
            "rounds_tok_s": [round(r, 3) for r in rates["fp32"]],
            "weights_bytes": fp32_bytes,
        },
        "variants": variant_figures,
        "environment": environment(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

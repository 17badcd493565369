"""How close the bf16 engine (EngineConfig.compute_dtype=bfloat16, over the same fp32 weights) stays to fp32.

    .venv/bin/python benchmarks/bf16_parity.py                       # 8 GSM8K chat prompts, greedy, 64 tokens
    .venv/bin/python benchmarks/bf16_parity.py --prompts 4 --threads 2

Prompts: the last --prompts questions of examples/data/gsm8k/train.jsonl through the model's chat template. Both
engines decode them greedily (EOS ignored, so every output is --max-tokens long). Reported:
- `greedy_match_fraction`: prompts whose bf16 output equals the fp32 engine's token for token;
  `first_divergence`: per prompt, the first output position where they differ (null: identical);
- `bf16_vs_trainer`: mean and max |logprob| difference between the bf16 engine's sampling logprobs and the fp32
  trainer forward's (the dense model over prompt + the bf16 engine's own output), on every output token: what an RL
  run's `mismatch/abs_diff_mean` / `_max` measure; `fp32_vs_trainer` the same for the fp32 engine (the floor).
On a CPU without fast bf16 (AVX2) the bf16 matmuls are emulated and slow: keep the run small there; the figures
do not depend on the CPU beyond rounding. One JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.engine import LLM, SamplingParams  # noqa: E402
from posttrain.models.hub import load_model  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"


def held_out_prompts(tokenizer, count: int) -> list[list[int]]:
    lines = GSM8K.read_text().splitlines()[-count:]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": json.loads(line)["question"]}], add_generation_prompt=True, tokenize=True
        )
        for line in lines
    ]


@torch.no_grad()
def trainer_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The fp32 dense forward's logprobs of `output` after `prompt`: (len(output),)."""
    ids = torch.tensor([prompt + output])
    logits = model(ids)[0, len(prompt) - 1 : -1].float()  # (T, V): position i predicts output[i]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def engine_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


def against_trainer(model, prompts, runs) -> dict[str, float]:
    diffs = torch.cat(
        [
            (torch.tensor(logprobs) - trainer_logprobs(model, prompt, tokens)).abs()
            for prompt, (tokens, logprobs) in zip(prompts, runs)
        ]
    )
    return {"abs_diff_mean": round(diffs.mean().item(), 5), "abs_diff_max": round(diffs.max().item(), 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    model.eval()
    prompts = held_out_prompts(tokenizer, args.prompts)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model, tokenizer, compute_dtype=dtype, max_model_len=max(map(len, prompts)) + args.max_tokens)
        runs[dtype] = engine_run(llm, prompts, args.max_tokens)
        print(f"{dtype} engine done", file=sys.stderr, flush=True)
        del llm
    divergence = []
    for (a, _), (b, _) in zip(runs["float32"], runs["bfloat16"]):
        divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    result = {
        "benchmark": "bf16_parity",
        "model": args.model,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "greedy_match_fraction": round(sum(d is None for d in divergence) / len(divergence), 3),
        "first_divergence": divergence,
        "bf16_vs_trainer": against_trainer(model, prompts, runs["bfloat16"]),
        "fp32_vs_trainer": against_trainer(model, prompts, runs["float32"]),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

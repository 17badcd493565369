"""Batch-1 greedy decode with and without speculative decoding: the same model, the same prompts, one run.

    .venv/bin/python benchmarks/speculative.py                          # n-gram drafts, 128 tokens
    .venv/bin/python benchmarks/speculative.py --draft-model /tmp/student15   # also a draft model
    # a draft model: posttrain convert --model smollm2-135m --out /tmp/student15 --num-layers 15

Prompts: a few held-out chat requests (written here, in no training set) and one that asks the model to repeat
a passage, where n-gram drafts shine. Each prompt runs alone (batch 1), greedy, EOS ignored, so every run makes
exactly --max-tokens tokens; each engine gets one warm-up request first. Reported per prompt set: tokens/s of
the plain engine and of each speculative one, their ratio, the acceptance rate (accepted / drafted tokens), the
mean accepted length (drafts accepted per checking step) and the fraction of prompts whose greedy output is
token for token the plain engine's. Prints progress to stderr and one JSON object as the last line of stdout.
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
from posttrain.models.hub import load_model  # noqa: E402

CHAT_PROMPTS = [
    "What are three good habits for keeping a small vegetable garden healthy?",
    "Explain in simple words why the sky looks blue during the day.",
    "Write a short, friendly email asking a colleague to move our meeting to Thursday.",
]
PASSAGE = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to five "
    "books at a time for three weeks. Late returns cost ten cents a day. The reading room on the second floor "
    "is quiet at all times, and the children's corner hosts a story hour every Saturday at eleven."
)
REPEAT_PROMPTS = [f"Repeat the following text exactly, word for word, twice:\n\n{PASSAGE}"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_engine(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    before = llm.stats()
    outputs, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([[{"role": "user", "content": prompt}]], params)[0]
        seconds += time.perf_counter() - start
        outputs.append(out.outputs[0].token_ids)
    after = llm.stats()
    generated = sum(len(o) for o in outputs)
    result = {
        "tokens_per_s": round(generated / seconds, 2),
        "seconds": round(seconds, 2),
        "steps": after["steps"] - before["steps"],
    }
    if "spec_draft_tokens" in after:
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        checks = after["spec_verifications"] - before["spec_verifications"]
        result["acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
        result["mean_accepted_length"] = round(accepted / checks, 3) if checks else 0.0
    return {"result": result, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft-model", default=None, help="also run a draft model (a name or directory)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--chat-prompts", type=int, default=len(CHAT_PROMPTS), help="how many of the chat prompts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device="cpu")
    engines = {"plain": LLM(model, tokenizer, max_num_seqs=1)}
    spec = {"num_tokens": args.num_speculative_tokens}
    engines["ngram"] = LLM(model, tokenizer, max_num_seqs=1, speculative={"method": "ngram", **spec})
    if args.draft_model:
        draft, _ = load_model(args.draft_model, device="cpu")
        engines["draft"] = LLM(
            model, tokenizer, max_num_seqs=1, speculative={"method": "draft", **spec}, draft_model=draft
        )
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "threads": torch.get_num_threads()}
    for set_name, prompts in (("chat", CHAT_PROMPTS[: args.chat_prompts]), ("repeat", REPEAT_PROMPTS)):
        runs = {}
        for name, llm in engines.items():
            log(f"{set_name}: {name} ...")
            runs[name] = run_engine(llm, prompts, args.max_tokens)
            log(f"{set_name}: {name} {runs[name]['result']}")
        plain = runs["plain"]
        entry = {"plain": plain["result"]}
        for name in engines:
            if name == "plain":
                continue
            result = runs[name]["result"]
            result["speedup"] = round(result["tokens_per_s"] / plain["result"]["tokens_per_s"], 3)
            same = sum(a == b for a, b in zip(runs[name]["outputs"], plain["outputs"]))
            result["identical_fraction"] = round(same / len(prompts), 3)
            entry[name] = result
        report[set_name] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()

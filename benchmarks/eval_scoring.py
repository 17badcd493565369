"""Scoring sequences for `posttrain eval ppl / preference`: a dense forward pass against the engine's prompt
logprobs, on the same token rows, one JSON line.

    .venv/bin/python benchmarks/eval_scoring.py                       # 64 GSM8K answers + 32 hh-rlhf pairs
    .venv/bin/python benchmarks/eval_scoring.py --rows 16 --pairs 8 --rounds 1

Workloads, on the embedded SmolLM2-135M (fp32 on CPU):
- ppl: GSM8K answers (rows 7000.., as in docs/eval.md), every token after the first scored. `dense` is the
  forward pass `posttrain eval ppl` used before it moved to the engine: rows longest first, right-padded
  batches, the LM head in chunks of 2048 positions.
- dpo: hh-rlhf pairs tokenized as `posttrain eval preference` does, completion tokens scored. `dense` is
  the DPO trainer's `frozen_logps` (the LM head on completion positions only), which the eval used before.
`engine` is posttrain/eval/scoring.py (what the evals run now). Each (workload, path) runs in its own
process, alternating, round after round; the best time of each counts (the machine is shared: quote
ratios), and peak RSS is the process's ru_maxrss after loading the model and scoring once.
`max_abs_diff`: the largest difference between the two paths' per-row sums.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"
HH = ROOT / "examples" / "data" / "hh-rlhf" / "harmless-pairs.jsonl.gz"
DENSE_LOGIT_CHUNK = 2048


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ppl_rows(tokenizer, count: int) -> list:  # noqa: ANN001
    from posttrain.data.tokenize import TokenizedRow
    from posttrain.eval.perplexity import read_texts, tokenize_texts

    rows, _ = tokenize_texts(tokenizer, read_texts(GSM8K, "answer", skip=7000, max_rows=count), 1024)
    return [TokenizedRow(ids, [-100] + ids[1:]) for ids in rows]  # every token after the first is scored


def dpo_rows(tokenizer, count: int, batch_size: int) -> list:  # noqa: ANN001
    """The pairs' rows in the order `eval preference` scores them (waves of chosen rows, then their rejected)."""
    from posttrain.data.preference_pairs import tokenize_pair_for_policy
    from posttrain.eval.preference import read_pairs, rows_in_waves

    pairs, _ = read_pairs(HH, tokenizer, tokenize_pair_for_policy, max_rows=count)
    return rows_in_waves(pairs, batch_size)[0]


@torch.no_grad()
def dense_ppl_sums(model, rows, batch_size: int) -> list[float]:  # noqa: ANN001
    """The previous `eval ppl` forward pass, per row: longest first, right-padded, LM head in chunks."""
    import torch.nn.functional as F

    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    sums = [0.0] * len(rows)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        lengths = torch.tensor([len(rows[i]) for i in index])
        ids = torch.zeros(len(index), int(lengths.max()), dtype=torch.long)  # (B, T)
        for b, i in enumerate(index):
            ids[b, : len(rows[i])] = torch.tensor(rows[i].input_ids)
        hidden = model.hidden_states(ids)  # (B, T, d)
        scored = torch.arange(ids.shape[1] - 1)[None, :] < (lengths[:, None] - 1)  # (B, T-1)
        h, targets = hidden[:, :-1][scored], ids[:, 1:][scored]  # (n, d), (n,)
        owner = scored.nonzero()[:, 0]  # (n,) batch row of each scored position
        per_token = torch.cat(
            [
                -F.cross_entropy(
                    model.logits(h[c : c + DENSE_LOGIT_CHUNK]), targets[c : c + DENSE_LOGIT_CHUNK], reduction="none"
                )
                for c in range(0, h.shape[0], DENSE_LOGIT_CHUNK)
            ]
        )  # (n,)
        for b, i in enumerate(index):
            sums[i] = float(per_token[owner == b].double().sum())
    return sums


def run_one(workload: str, path: str, count: int, batch_size: int) -> dict:
    """One (workload, path) in this process: time, per-row sums."""
    from posttrain.models.hub import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model, tokenizer = load_model("smollm2-135m", dtype="float32", device="cpu")
    rows = ppl_rows(tokenizer, count) if workload == "ppl" else dpo_rows(tokenizer, count, batch_size)
    start = time.perf_counter()
    if path == "engine":
        from posttrain.eval.preference import completion_logps

        sums = completion_logps(model, rows, batch_size).tolist()
    elif workload == "ppl":
        sums = dense_ppl_sums(model, rows, batch_size)
    else:
        from posttrain.trainers.preference.logps import frozen_logps

        sums = frozen_logps(model, rows, batch_size, tokenizer.pad_token_id or 0).double().tolist()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "sums": sums, "tokens": sum(len(r) for r in rows), "rows": len(rows)}


def spawn(workload: str, path: str, count: int, batch_size: int) -> dict:
    """run_one in a child process; adds its peak RSS from the kernel."""
    argv = [sys.executable, __file__, "--child", workload, path, str(count), str(batch_size)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{workload}/{path} failed with status {status}")
    result = json.loads(out)
    result["peak_rss_mb"] = round(usage.ru_maxrss / 1024)  # Linux: KiB
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="GSM8K answers for the ppl workload")
    parser.add_argument("--pairs", type=int, default=32, help="hh-rlhf pairs for the dpo workload")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload, path, count, batch_size = args.child
        print(json.dumps(run_one(workload, path, int(count), int(batch_size))))
        return
    report: dict = {
        "model": "smollm2-135m",
        "dtype": "float32",
        "batch_size": args.batch_size,
        "threads": int(os.environ.get("OMP_NUM_THREADS", "2")),
    }
    for workload, count in (("ppl", args.rows), ("dpo", args.pairs)):
        runs: dict[str, list[dict]] = {"dense": [], "engine": []}
        for round_ in range(args.rounds):
            for path, results in runs.items():
                results.append(spawn(workload, path, count, args.batch_size))
                log(
                    f"{workload} round {round_} {path}: {results[-1]['seconds']:.1f} s, {results[-1]['peak_rss_mb']} MB"
                )
        seconds = {path: min(r["seconds"] for r in results) for path, results in runs.items()}
        peak = {path: max(r["peak_rss_mb"] for r in results) for path, results in runs.items()}
        dense, engine = runs["dense"][0], runs["engine"][0]
        report[workload] = {
            "rows": dense["rows"],
            "tokens": dense["tokens"],
            "dense_s": round(seconds["dense"], 2),
            "engine_s": round(seconds["engine"], 2),
            "engine_over_dense_time": round(seconds["engine"] / seconds["dense"], 3),
            "dense_peak_rss_mb": peak["dense"],
            "engine_peak_rss_mb": peak["engine"],
            "max_abs_diff": max(abs(a - b) for a, b in zip(dense["sums"], engine["sums"])),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""The engine's bf16 linear layers: posttrain's bf16 GEMM (posttrain/kernels/bf16_linear.c over packed copies)
against oneDNN's (torch's F.linear in bf16 over row-major copies, what the engine ran before), on the same inputs.

    .venv/bin/python benchmarks/bf16_linear.py                     # rows 1, 4, 16, 64, 256, 512
    .venv/bin/python benchmarks/bf16_linear.py --rows 1,64 --layers 30

The default model's decoder weights (SmolLM2-135M: q, k, v, o, gate, up, down per layer; --layers of them, 30 by
default, so they do not fit the last-level cache, as in a decode step), fp32 inputs of each row count. Both sides do
the same work: round the input to bf16, multiply, return fp32 (oneDNN: x.bfloat16() then .float() of its bf16
output; the kernel rounds in place and widens its own). Each side's time is the best of --reps passes over all the
weights after a warm-up pass, the two sides interleaved. The fastest side depends on the CPU: AVX512-BF16 runs
vdpbf16ps, elsewhere the kernel's plain C (correct, slow: use it to test). Prints one JSON object as the last
line of stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import best_of  # noqa: E402  (benchmarks/timing.py)

from posttrain import kernels  # noqa: E402
from posttrain.hardware import cpu_features  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query heads and 3 K/V heads of 64, MLP 1536; (out_features, in_features).
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def run_posttrain(inputs: dict[int, torch.Tensor], packed: list[torch.Tensor], shapes: list[tuple[int, int]]) -> None:
    for copy, (n, k) in zip(packed, shapes):
        kernels.bf16_linear(inputs[k], copy, n)


def run_onednn(inputs: dict[int, torch.Tensor], row_major: list[torch.Tensor], shapes: list[tuple[int, int]]) -> None:
    for copy, (_, k) in zip(row_major, shapes):
        F.linear(inputs[k].bfloat16(), copy).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64,256,512", help="comma-separated input row counts")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if kernels.library() is None:
        sys.exit("the native kernels could not be built here (see the warning above)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * args.layers
    weights = [torch.randn(n, k) / k**0.5 for n, k in shapes]
    packed = [kernels.bf16_pack(w) for w in weights]  # posttrain's copies
    row_major = [w.bfloat16() for w in weights]  # oneDNN's
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in {k for _, k in LAYER_SHAPES}}
        flops = sum(2 * rows * n * k for n, k in shapes)

        ours = functools.partial(run_posttrain, inputs, packed, shapes)
        onednn = functools.partial(run_onednn, inputs, row_major, shapes)
        times = {"posttrain": float("inf"), "onednn": float("inf")}
        for _ in range(2):  # interleaved: a drift in the machine's speed hits both sides
            times["posttrain"] = min(times["posttrain"], best_of(ours, args.reps))
            times["onednn"] = min(times["onednn"], best_of(onednn, args.reps))
        row = {
            "rows": rows,
            "posttrain_ms": round(times["posttrain"] * 1e3, 2),
            "onednn_ms": round(times["onednn"] * 1e3, 2),
            "posttrain_gflops": round(flops / times["posttrain"] / 1e9, 1),
            "onednn_gflops": round(flops / times["onednn"] / 1e9, 1),
            "ratio": round(times["onednn"] / times["posttrain"], 2),
        }
        print(row, flush=True)
        results.append(row)
    cpu = cpu_features()
    print(
        json.dumps(
            {
                "benchmark": "bf16_linear",
                "threads": args.threads,
                "layers": args.layers,
                "cpu": cpu.model,
                "fast_bf16": cpu.fast_bf16,
                "weight_mb": round(sum(n * k * 2 for n, k in shapes) / 2**20, 1),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()

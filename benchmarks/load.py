"""Time to load the default model once it is converted: posttrain `load_model` against transformers
`from_pretrained` on the same cached HF directory, each in a fresh process (imports included).

    .venv/bin/python benchmarks/load.py [--repeats 3]

Prints one JSON line: median seconds of each and the ratio (transformers / posttrain).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

OURS = "from posttrain import load_model; load_model('smollm2-135m', device='cpu')"
THEIRS = (
    "import torch, transformers; from posttrain.models.hub import resolve_model_path; "
    "p = resolve_model_path('smollm2-135m'); "
    "transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32); transformers.AutoTokenizer.from_pretrained(p)"
)


def wall_time(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-c", OURS], check=True)  # make sure the conversion is cached
    ours = statistics.median(wall_time(OURS) for _ in range(args.repeats))
    theirs = statistics.median(wall_time(THEIRS) for _ in range(args.repeats))
    print(
        json.dumps(
            {
                "posttrain_load_s": round(ours, 3),
                "transformers_load_s": round(theirs, 3),
                "ratio": round(theirs / ours, 2),
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()

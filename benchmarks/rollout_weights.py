"""The rollout engine under FSDP2: `dist.rollout_weights=whole` against `per_layer`, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/rollout_weights.py [--model smollm2-135m] [--prompts 8] [--samples 4] [--max-tokens 32]

Each rank loads the model in fp32, shards it with FSDP2 (`Parallel`, one group per decoder layer and the root),
builds an engine over it and samples its strided share of the prompts (every request seeded, so both settings
draw the same tokens), under each setting in turn, --repeats times, alternating. Per setting, the largest
figure over the ranks:

  gathered_mb   the most full-size (unsharded) parameter bytes on the rank at any engine forward, read by a
                hook that runs after FSDP2's pre-forward gather of each layer: whole = every parameter;
                per_layer = the root group's (embeddings / tied LM head, final norm) + one decoder layer
  shards_mb     the rank's own shards, held in both settings (1/N of the parameters)
  rollout_s     wall time of one rollout (the fastest of the repeats)
  forwards      engine forwards of the rank (per_layer: including the idle ones, run while another rank works)
  all_gathers   FSDP2 all-gathers of the rollout, from the forwards: whole, one per group (the layers and the
                root); per_layer, the root's once and every layer's in every forward

and `same_samples`: both settings sampled the same token ids on every rank. Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.distributed.config import DistSection  # noqa: E402
from posttrain.distributed.env import all_gather_objects, init_distributed  # noqa: E402
from posttrain.distributed.lockstep import Lockstep  # noqa: E402
from posttrain.distributed.parallel import Parallel  # noqa: E402
from posttrain.engine import LLM, SamplingParams  # noqa: E402
from posttrain.models.hub import load_model  # noqa: E402

TOPICS = [
    "a lighthouse",
    "the first snow of the year",
    "a lost key",
    "two rival chess clubs",
    "a robot learning to cook",
    "the last train home",
    "an old map",
    "a garden on the moon",
]
MB = 2**20


def full_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters registered whole (not as FSDP2 DTensor shards) on the model right now."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


@contextlib.contextmanager
def rollout_weights(parallel: Parallel, mode: str) -> Iterator[Lockstep]:
    """`Parallel.rollout` as `dist.rollout_weights=mode` makes it (the parallel's section says per_layer)."""
    if mode == "per_layer":
        with parallel.rollout() as lockstep:
            yield lockstep
        return
    with parallel.full_weights():
        yield Lockstep.off()


def rollout(llm: LLM, parallel: Parallel, mode: str, prompts: list[Any], params: list[SamplingParams]) -> dict:
    """One rollout of this rank's prompts; its figures and the sampled token ids."""
    model = parallel.model
    peak = [0]

    def after_gather(module: torch.nn.Module, args: object) -> None:  # appended: after FSDP2's pre-forward
        peak[0] = max(peak[0], full_bytes(model))

    hooks = [layer.register_forward_pre_hook(after_gather) for layer in model.layers]
    steps = llm.engine.num_steps
    start = time.perf_counter()
    try:
        with rollout_weights(parallel, mode) as lockstep:
            with lockstep():
                outputs = llm.generate(prompts, params)
    finally:
        for hook in hooks:
            hook.remove()
    forwards = llm.engine.num_steps - steps + lockstep.idle_forwards
    layers = len(model.layers)
    return {
        "rollout_s": time.perf_counter() - start,
        "gathered_mb": peak[0] / MB,
        "forwards": forwards,
        "all_gathers": 1 + (forwards * layers if lockstep.active else layers),
        "tokens": [list(s.token_ids) for o in outputs for s in o.outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ctx = init_distributed("fsdp2", "cpu")
    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    shards_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / MB / ctx.world_size
    parallel = Parallel(model, DistSection(strategy="fsdp2", rollout_weights="per_layer"), ctx)
    with parallel.rollout():
        llm = LLM(model=model, tokenizer=tokenizer, max_num_seqs=args.prompts * args.samples, num_kv_blocks=512)
    topics = (TOPICS * args.prompts)[: args.prompts]
    mine = list(range(ctx.rank, args.prompts, ctx.world_size))
    prompts = [[{"role": "user", "content": f"Write a short story about {topics[i]}."}] for i in mine]
    params = [SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, seed=1000 * i) for i in mine]
    runs: dict[str, list[dict]] = {"whole": [], "per_layer": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(rollout(llm, parallel, mode, prompts, params))
    figures = {}
    for mode, done in runs.items():
        best = min(done, key=lambda r: r["rollout_s"])
        figures[mode] = {k: v for k, v in best.items() if k != "tokens"}
    same = all(r["tokens"] == runs["whole"][0]["tokens"] for done in runs.values() for r in done)
    ranks = all_gather_objects((figures, same))
    if ctx.rank == 0:
        result = {
            "model": args.model,
            "ranks": ctx.world_size,
            "prompts": args.prompts,
            "samples": args.samples,
            "max_tokens": args.max_tokens,
            "shards_mb": round(shards_mb, 1),
            "same_samples": all(s for _, s in ranks),
        }
        for mode in runs:
            result[mode] = {key: round(max(f[mode][key] for f, _ in ranks), 3) for key in figures[mode]}
        result["gathered_ratio"] = round(result["whole"]["gathered_mb"] / result["per_layer"]["gathered_mb"], 2)
        result["time_ratio"] = round(result["per_layer"]["rollout_s"] / result["whole"]["rollout_s"], 2)
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

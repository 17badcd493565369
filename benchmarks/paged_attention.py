"""One layer's decode attention at rollout shapes: the native kernel, posttrain's PyTorch path, and the
dense layout transformers decodes with (a padded (B, Hkv, L, D) cache through SDPA), on the same tensors.

    .venv/bin/python benchmarks/paged_attention.py                 # 64 prompts x 8 samples, 72 own tokens
    .venv/bin/python benchmarks/paged_attention.py --own-tokens 136

SmolLM2-135M's attention shapes (9 query heads, 3 K/V heads, head_dim 64), fp32, blocks of 16 tokens
scattered over a pool the size the engine allocates by default here (8300 blocks), backed by 2 MiB pages
as the engine's pool is. Each group's samples share `--prompt-tokens` of prompt blocks. Times are the best
of --reps after a warm-up. Repeated calls find part of the K/V in the last-level cache, which a rollout
(30 layers' K/V between two reads) does not: compare the figures, do not multiply them out. The PyTorch
path is timed as a step that gathers its blocks (in a rollout, decode_staging spares most steps that).
Prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import best_of  # noqa: E402  (benchmarks/timing.py)

from posttrain import kernels  # noqa: E402
from posttrain.cpu_malloc import advise_huge_pages  # noqa: E402
from posttrain.models.attention import PagedAttentionMetadata  # noqa: E402
from posttrain.models.paged_attention import paged_attention  # noqa: E402

BS, HKV, HEADS_PER_KV, D = 16, 3, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=80, help="shared prompt tokens per group (whole blocks)")
    parser.add_argument("--own-tokens", type=int, default=72, help="each sample's tokens after the shared prompt")
    parser.add_argument("--pool-blocks", type=int, default=8300)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if kernels.library() is None:
        sys.exit("the native kernels could not be built here (see the warning above)")
    torch.manual_seed(0)
    rng = random.Random(0)
    cache = torch.empty(2, args.pool_blocks, BS, HKV, D)
    advise_huge_pages(cache.data_ptr(), cache.numel() * cache.element_size())
    cache.normal_()
    free = list(range(1, args.pool_blocks))
    rng.shuffle(free)
    tables, ctx = [], []
    for _ in range(args.prompts):
        shared = [free.pop() for _ in range(args.prompt_tokens // BS)]
        for _ in range(args.n):
            length = len(shared) * BS + args.own_tokens - rng.randint(0, BS - 1)  # prompts end mid-block
            tables.append(shared + [free.pop() for _ in range(-(-length // BS) - len(shared))])
            ctx.append(length)
    S, H = len(tables), HKV * HEADS_PER_KV
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([t[(c - 1) // BS] * BS + (c - 1) % BS for t, c in zip(tables, ctx)])
    meta = PagedAttentionMetadata([cache], slots, block_tables, torch.tensor(ctx), torch.ones(S, dtype=torch.long), 1)
    q, k, v = torch.randn(S, H, D), torch.randn(S, HKV, D), torch.randn(S, HKV, D)

    # transformers' decode layout: every sequence's K/V contiguous, padded to the longest, and a mask.
    L = max(ctx)
    dense_k = torch.zeros(S, HKV, L, D)
    dense_v = torch.zeros(S, HKV, L, D)
    for s, (t, c) in enumerate(zip(tables, ctx)):
        dense_k[s, :, :c] = cache[0][t].reshape(-1, HKV, D)[:c].transpose(0, 1)
        dense_v[s, :, :c] = cache[1][t].reshape(-1, HKV, D)[:c].transpose(0, 1)
    mask = (torch.arange(L)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]  # (S, 1, 1, L)

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, attn_mask=mask, enable_gqa=True)

    native = best_of(lambda: paged_attention(q, k, v, meta, 0), args.reps)
    supports = kernels.supports
    kernels.supports = lambda q, cache: False
    try:
        pytorch = best_of(lambda: paged_attention(q, k, v, meta, 0), args.reps)
    finally:
        kernels.supports = supports
    transformers_layout = best_of(dense, args.reps)
    shared_tokens = args.prompt_tokens // BS * BS
    kv_tokens = args.prompts * shared_tokens + sum(ctx) - S * shared_tokens  # shared blocks once, own tokens each
    kv_bytes = kv_tokens * HKV * D * 4 * 2
    print(
        json.dumps(
            {
                "benchmark": "paged_attention",
                "shape": {
                    "sequences": S,
                    "groups": args.prompts,
                    "prompt_tokens": args.prompt_tokens,
                    "own_tokens": args.own_tokens,
                    "heads": H,
                    "kv_heads": HKV,
                    "head_dim": D,
                },
                "threads": torch.get_num_threads(),
                "kv_mb_read": round(kv_bytes / 1e6, 1),
                "native_ms": round(native * 1e3, 2),
                "pytorch_path_ms": round(pytorch * 1e3, 2),
                "transformers_layout_sdpa_ms": round(transformers_layout * 1e3, 2),
                "native_vs_pytorch_path": round(pytorch / native, 2),
                "native_vs_transformers_layout": round(transformers_layout / native, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

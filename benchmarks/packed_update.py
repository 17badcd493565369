"""The RL update's forward + backward on multi-turn episodes, in four layouts of the same batch, one JSON line.

    .venv/bin/python benchmarks/packed_update.py                 # 4 games x 8 episodes shaped like guess_number
    .venv/bin/python benchmarks/packed_update.py --rounds 3 --dtype auto     # bf16 autocast where bf16 is fast
    .venv/bin/python benchmarks/packed_update.py --groups 1 --episodes 4 --rounds 1   # a quick look

The batch: `--groups` prompts of `--prompt-tokens` tokens, each with `--episodes` episodes of 4-7 turns; a turn is
3-4 model tokens then a 20-22 token observation (the guessing game's "Higher. It is between 58 and 100. 6 guesses
left." and the chat markup), so ~12% of an episode is the model's. The loss is every model token's logprob (the
observations are context only), its backward through the whole model. Layouts, each timed on the same tensors:

  rows        one padded row per episode, [prompt, episode], logits at every position, then masked (the plain
              layout: transformers' / TRL's)
  packed      one row per group, the prompt once (posttrain/trainers/packed_groups.py), logits at every episode
              token (the update before logits were restricted to the model's tokens)
  scored      packed, logits at the model's tokens only
  scored_cut  scored, groups wider than ROW_TOKENS cut into rows (what the update runs now)

Each layout is warmed up once (excluded); then the rounds alternate the layouts' order (benchmarks/alternation.py)
and each round times one forward + backward per layout. All four must give the same loss (to the sums' order),
which checks that they computed the same thing. Prints one JSON line: every layout's median seconds, and the
ratios against `rows` and `packed` (above 1: scored_cut is faster).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from alternation import alternate, ratio_summary  # noqa: E402
from provenance import environment  # noqa: E402

from posttrain.algos import token_logprobs  # noqa: E402
from posttrain.hardware import auto_dtype  # noqa: E402
from posttrain.models.hub import load_model  # noqa: E402
from posttrain.trainers.packed_groups import ROW_TOKENS, pack_groups, packed_forward  # noqa: E402

LAYOUTS = ("rows", "packed", "scored", "scored_cut")


def episode(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    """(token ids, model mask) of one game: 4-7 turns of a 3-4 token guess and a 20-22 token answer."""
    ids, mask = [], []
    for _ in range(rng.randint(4, 7)):
        for is_model, count in ((1, rng.randint(3, 4)), (0, rng.randint(20, 22))):
            ids += [rng.randrange(vocab) for _ in range(count)]
            mask += [is_model] * count
    return ids, mask


def padded_rows(prompts, episodes, masks) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain layout's inputs: (B, W) right-padded rows [prompt, episode] and the (B, W - 1) mask of the
    targets that are the model's tokens."""
    flat = [(p, e, m) for p, group, group_masks in zip(prompts, episodes, masks) for e, m in zip(group, group_masks)]
    width = max(len(p) + len(e) for p, e, _ in flat)
    ids = torch.zeros(len(flat), width, dtype=torch.long)
    target_mask = torch.zeros(len(flat), width - 1)
    for b, (p, e, m) in enumerate(flat):
        ids[b, : len(p) + len(e)] = torch.tensor(p + e)
        target_mask[b, len(p) - 1 : len(p) - 1 + len(e)] = torch.tensor(m, dtype=torch.float32)
    return ids, target_mask


def model_token_mask(masks, width: int) -> torch.Tensor:
    """(B, width) the packed layouts' per-sample mask of the model's tokens."""
    flat = [m for group in masks for m in group]
    target = torch.zeros(len(flat), width)
    for b, m in enumerate(flat):
        target[b, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=8, help="episodes per group (the group size)")
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "auto"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.groups, args.episodes, args.prompt_tokens, args.rounds) < 1:
        parser.error("--groups, --episodes, --prompt-tokens and --rounds must be positive")
    model, _ = load_model(args.model, dtype="float32", device="cpu")
    model.train()
    compute = torch.float32
    if args.dtype == "auto" and auto_dtype("cpu").dtype == "bfloat16":
        compute = torch.bfloat16
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.groups)]
    played = [[episode(rng, vocab) for _ in range(args.episodes)] for _ in range(args.groups)]
    episodes = [[ids for ids, _ in group] for group in played]
    masks = [[mask for _, mask in group] for group in played]
    packs = {
        "packed": pack_groups(prompts, episodes),
        "scored": pack_groups(prompts, episodes, scored=masks),
        "scored_cut": pack_groups(prompts, episodes, scored=masks, row_tokens=ROW_TOKENS),
    }

    row_ids, row_targets = padded_rows(prompts, episodes, masks)  # built once: the timing is the forward's
    packed_targets = model_token_mask(masks, packs["packed"].max_len)

    def loss_of(layout: str) -> torch.Tensor:
        if layout == "rows":
            logits = model(row_ids)[:, :-1]  # (B, W - 1, V); padding is on the right, after every real token
            return (token_logprobs(logits, row_ids[:, 1:], 1.0) * row_targets).sum()
        out = packed_forward(model, packs[layout], 1.0)  # (B, L) logprobs, 0 where nothing was gathered
        return (out.logprobs * packed_targets).sum()

    losses: dict[str, float] = {}

    def step(layout: str) -> float:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if compute == torch.bfloat16 else nullcontext()
        start = time.perf_counter()
        with autocast:
            loss = loss_of(layout)
        loss.backward()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        losses[layout] = float(loss.detach())
        return seconds

    for layout in LAYOUTS:  # warm-up, excluded
        step(layout)
    figures = alternate({layout: (lambda layout=layout: step(layout)) for layout in LAYOUTS}, args.rounds)
    reference = losses["rows"]
    tolerance = 1e-3 * abs(reference) if compute == torch.float32 else 2e-2 * abs(reference)
    agree = all(abs(value - reference) <= tolerance for value in losses.values())
    tokens = sum(len(e) for group in episodes for e in group)
    model_tokens = sum(sum(m) for group in masks for m in group)
    result = {
        "benchmark": "packed_update",
        "model": args.model,
        "dtype": "bfloat16 autocast over float32" if compute == torch.bfloat16 else "float32",
        "groups": args.groups,
        "episodes_per_group": args.episodes,
        "prompt_tokens": args.prompt_tokens,
        "episode_tokens": tokens,
        "model_tokens": model_tokens,
        "rows_by_layout": {name: int(pack.input_ids.shape[0]) for name, pack in packs.items()},
        "width_by_layout": {name: int(pack.input_ids.shape[1]) for name, pack in packs.items()},
        "row_tokens": ROW_TOKENS,
        "seconds_median": {name: round(statistics.median(values), 3) for name, values in figures.items()},
        "losses": {name: round(value, 4) for name, value in losses.items()},
        "losses_agree": agree,
        "scored_cut_vs_packed": ratio_summary(figures["scored_cut"], figures["packed"], higher_is_better=False),
        "scored_cut_vs_rows": ratio_summary(figures["scored_cut"], figures["rows"], higher_is_better=False),
        "environment": environment(),
    }
    print(json.dumps(result))
    if not agree:
        sys.exit(f"packed_update: the layouts' losses differ beyond {tolerance:.3g}: {losses}")


if __name__ == "__main__":
    main()

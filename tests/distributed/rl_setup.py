"""The RL data-parallel tests' common setup: a tiny model saved with the default tokenizer, a reward with
spread inside every group, and the overrides every 2-vs-1 process comparison shares."""

from __future__ import annotations

from pathlib import Path

from posttrain.models.checkpoint_io import save_hf_dir
from tests.numeric import EQUIVALENCE_EPS
from tests.trainers.rl_helpers import reward_file, tiny_model, tokenizer

LR = 1e-2


def rl_overrides(root: Path, *extra: str) -> list[str]:
    """4 prompts a step (each seeded by its place, `rollout.seed_prompts`), 6 new tokens, 2 steps, + `extra`.

    optim.eps: AdamW's first step is lr * g / (|g| + eps). Over this 49152-token tied vocabulary most rows of the
    LM head get gradients at rounding level (~1e-10, rare tokens' probabilities); with eps=1e-8 each would take a
    near-full step whose size is set by the rounding of the summation order, which two processes change.
    EQUIVALENCE_EPS bounds AdamW's gain on that rounding (tests/numeric.py).

    rollout.top_k: the runs compute the same logits in other batch shapes (each rank samples its own prompts),
    so they agree to rounding only, and a draw whose uniform lands within that rounding of a CDF step takes
    another token (tests/distributed/equivalence.py). The random model's distribution is flat over 49152 tokens
    (logits' std ~1.1, the likeliest token ~0.3%), so its steps are ~1e-4 apart; among its 8 likeliest tokens they
    are ~0.1 apart, which makes such a flip about ten times rarer (one in the suite happened under AVX2 kernels)."""
    tok = tokenizer()
    model = save_hf_dir(tiny_model(tok), root / "model", tokenizer=tok)
    return [
        f"model.name_or_path={model}",
        f"reward.functions=[{reward_file(root)}:char_mix]",
        "rollout.prompts_per_step=4",
        "rollout.max_tokens=6",
        "rollout.top_k=8",
        "rollout.seed_prompts=true",
        "train.max_steps=2",
        f"optim.lr={LR}",
        f"optim.eps={EQUIVALENCE_EPS}",
        "data.eval_size=0",
        "log.progress=false",
        *extra,
    ]

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
    EQUIVALENCE_EPS bounds AdamW's gain on that rounding (tests/numeric.py)."""
    tok = tokenizer()
    model = save_hf_dir(tiny_model(tok), root / "model", tokenizer=tok)
    return [
        f"model.name_or_path={model}",
        f"reward.functions=[{reward_file(root)}:char_mix]",
        "rollout.prompts_per_step=4",
        "rollout.max_tokens=6",
        "rollout.seed_prompts=true",
        "train.max_steps=2",
        f"optim.lr={LR}",
        f"optim.eps={EQUIVALENCE_EPS}",
        "data.eval_size=0",
        "log.progress=false",
        *extra,
    ]

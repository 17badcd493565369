"""One round of GRPO on a verifiers ToolEnv's episodes, collected through a running `posttrain serve` (docs/agents.md
"verifiers environments through the server"). Needs `pip install 'posttrain[verifiers]'`.

    posttrain serve --model smollm2-135m --dtype float32 --chat-template chatml_tools --tool-call-parser hermes &
    python examples/verifiers_grpo.py --model smollm2-135m --out runs/vf-round1

then serve runs/vf-round1 and run the script again with --model runs/vf-round1 for the next round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random

import torch
import verifiers as vf
from datasets import Dataset

from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.hub import load_model
from posttrain.rollout.served_episodes import samples_from_verifiers
from posttrain.trainers.episode_grpo import grpo_update


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def answered(completion, answer: str, **kwargs) -> float:
    """1 when the last assistant message states the sum."""
    last = [m for m in completion if m["role"] == "assistant"][-1:]
    return float(bool(last) and answer in (last[0]["content"] or ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--model", default="smollm2-135m", help="what the server serves, by its --model (the weights trained here)"
    )
    parser.add_argument("--out", required=True, help="where the updated model is written (an HF directory)")
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()

    rng = random.Random(0)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(args.problems)]
    rows = Dataset.from_list([{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs])
    env = vf.ToolEnv(dataset=rows, tools=[add], rubric=vf.Rubric(funcs=[answered]), max_turns=3)

    os.environ.setdefault("POSTTRAIN_API_KEY", "unused")  # the server's key, when it was started with one
    client = vf.ClientConfig(api_base_url=args.base_url, api_key_var="POSTTRAIN_API_KEY", max_retries=0)
    # logprobs + return_token_ids: each step's prompt ids, sampled ids and their logprobs (verifiers keeps them in
    # state["trajectory"][i]["tokens"]); temperature must match grpo_update's
    sampling = {"temperature": 1.0, "max_tokens": 128, "logprobs": True, "extra_body": {"return_token_ids": True}}
    results = asyncio.run(
        env.evaluate(
            client,
            args.model,
            sampling_args=sampling,
            rollouts_per_example=args.group_size,
            state_columns=["trajectory"],
        )
    )
    samples = samples_from_verifiers(results["outputs"])
    rewards = [o["reward"] for o in results["outputs"]]
    print(f"{len(rewards)} episodes, mean reward {sum(rewards) / len(rewards):.3f}, {len(samples)} samples")

    model, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(grpo_update(model, optimizer, samples, temperature=sampling["temperature"]))
    save_hf_dir(model.eval(), args.out, tokenizer=tokenizer)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

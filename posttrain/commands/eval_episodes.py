"""`posttrain eval accuracy --config RL.yaml --model DIR --data FILE.jsonl [--json]`: greedy accuracy of a model
that plays the config's environment (its `env:` section, as the RL run's held-out evaluation plays it).

Each row becomes one greedy episode through the same runner as training; the episode is scored by the
environment (or by the config's / --reward's functions where the environment leaves it unscored). The rows'
prompt column is `--prompt-column` (default `prompt`, else `question` when the file has that instead), and every
other column reaches the environment and the reward functions.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from posttrain.errors import PosttrainError


def episodes_accuracy_run(args: argparse.Namespace) -> int:
    from posttrain.commands.eval_generation import prompt_column, write_samples
    from posttrain.config import load_config
    from posttrain.engine import LLM, EngineConfig
    from posttrain.eval.prompts import file_rows
    from posttrain.models.hub import load_model
    from posttrain.rewards import load_reward_specs
    from posttrain.rollout.episode_batch import EpisodeGroups, episode_metrics
    from posttrain.rollout.evaluate import evaluate
    from posttrain.trainers.rl.config import GRPOConfig
    from posttrain.trainers.rl.env_section import episode_options

    cfg = load_config(GRPOConfig, args.config)
    if cfg.env is None:
        raise PosttrainError(f"--config {args.config}: no env: section (it names the environment to evaluate in)")
    if args.data is None or args.builtin_task is not None:
        raise PosttrainError("with --config, give the problems as --data FILE (rows with a prompt or question)")
    if args.n != 1 or args.temperature != 0:
        raise PosttrainError("with --config the episodes are greedy: leave --n and --temperature at 1 and 0")
    data = file_rows(
        args.data,
        prompt_column(args),
        args.answer_column,
        max_rows=args.num,
        system_prompt=args.system,
        template=args.prompt_template,
        answer_required=False,  # the environment may score episodes itself (guess_number has no answer)
    )
    columns = [key for key in data.rows[0] if key != "prompt"]
    functions = args.reward or cfg.reward.functions
    specs = load_reward_specs(functions, columns, None) if functions else []  # else: the environment scores
    max_tokens = args.max_tokens or cfg.rollout.max_tokens
    model, tokenizer = load_model(
        args.model, dtype=args.dtype, device=args.device, chat_template=cfg.model.chat_template
    )
    options = episode_options(
        cfg.env, tokenizer, max_tokens, cfg.rollout.max_prompt_tokens, episodes_in_flight=len(data.rows)
    )
    seqs = min(EngineConfig().max_num_seqs, len(data.rows))
    engine = EngineConfig(
        max_model_len=args.max_model_len or cfg.rollout.max_prompt_tokens + cfg.env.max_episode_tokens,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(EngineConfig().max_num_batched_tokens, seqs),
    )
    episodes = EpisodeGroups(options)
    metrics, samples = evaluate(
        LLM(model=model, tokenizer=tokenizer, config=engine),
        data.rows,
        specs,
        max_tokens,
        args.threshold,
        generate=episodes,
    )
    env = episode_metrics(episodes.take_log())
    write_samples(args.samples, samples)
    accuracy = metrics["eval/accuracy"]
    result: dict[str, Any] = {
        "task": "accuracy",
        "model": str(args.model),
        "data": data.source,
        "config": str(args.config),
        "environment": cfg.env.name,
        "accuracy": None if math.isnan(accuracy) else accuracy,
        "problems": len(data.rows),
        "reward_mean": _number(metrics["eval/reward_mean"]),
        **{key: _number(value) for key, value in env.items() if isinstance(value, (int, float))},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    shown = "n/a (nothing scorable)" if result["accuracy"] is None else f"{accuracy:.4f}"
    print(
        f"accuracy {shown}  ({len(data.rows)} problems, greedy episodes in {cfg.env.name!r}: "
        f"{env['env/turns']:.2f} turns, {env['env/tool_calls']:.2f} tool calls per episode, "
        f"{env['env/truncated_frac']:.0%} truncated)"
    )
    return 0


def _number(value: float) -> float | None:
    """JSON has no NaN: a mean over nothing is null."""
    return None if math.isnan(value) else value

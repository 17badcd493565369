"""An agentic demo against its peer: posttrain's GRPO on tool-use episodes vs TRL's GRPOTrainer with the same
tool (`tools=[...]`), each for `--minutes` of wall time, one after the other, from the same weights.

`--task` picks the demo (its configs, tool, held-out file and cold start):
  calculator     examples/agent_calculator.yaml: multiplication with the `calculator` tool
  word_problems  examples/agent_word_problems.yaml: word problems of 2-4 chained `calculate` calls
  guess_number_tools  examples/agent_guess_number_tools.yaml: the guessing game with each guess a `guess` call
                 (a TRL environment_factory class, posttrain/envs/guess_number_tools.py, that both sides play
                 unchanged: TRL as `environment_factory=`, posttrain through its TRL adapter; reward: the game's)

Both sides: the cold-started default model (`--start`, default the demo's SFT output, e.g.
runs/calculator-sft/final from `posttrain sft examples/agent_calculator_sft.yaml`; run first when missing), the
`chatml_tools` template (saved with that checkpoint; TRL reads it through transformers), fresh training problems
of the demo's task with its environment's system prompt, the demo config's prompts x episodes a step, temperature,
beta 0, the `grpo` loss, AdamW at the demo config's learning rate, the environment's reward (1 when the final
turn's last number is the exact answer). Token limits: posttrain samples at most `rollout.max_tokens` a turn,
`env.max_turns` turns and `env.max_episode_tokens` after the prompt; TRL has no per-turn limit, so it gets the
episode budget as `max_completion_length` and `max_turns - 1` tool rounds (`max_tool_calling_iterations`).
TRL generates with transformers' `generate` (no vLLM on a CPU); the tool-call parser is TRL's Hermes/Qwen one
(our template writes that format).

Each side saves a snapshot of the model every `--minutes / --points` minutes of its own training time (the
saves are not counted); after both have trained, every snapshot is evaluated the same way, by
`posttrain eval accuracy --config <the demo's config>` on the first `--eval-size` problems of its held-out
file, examples/data/<task>/test.jsonl (greedy episodes with the tool): held-out accuracy and tool calls per
episode against training wall time. The start checkpoint is evaluated once, as both curves' first point.

Writes <out>/curves.json and <out>/curves.csv; prints per-step lines, then one JSON line:
    {"posttrain": {final figures}, "trl": {final figures}, "accuracy_ratio": ours / TRL, ...}

    .venv/bin/python benchmarks/agent_vs_trl.py [--minutes 30] [--eval-size 200] [--points 6] [--only trl]
        [--precision fp32|bf16]
    .venv/bin/python benchmarks/agent_vs_trl.py --task word_problems      # the word-problems demo, 30 min each
    .venv/bin/python benchmarks/agent_vs_trl.py --minutes 2 --eval-size 20 --points 1     # smoke run
    .venv/bin/python benchmarks/agent_vs_trl.py --dry-run     # the commands and settings, no compute

Precision is the same on both sides (benchmarks/matching.py): --precision fp32 (default) trains posttrain with
`model.dtype: float32` and TRL in fp32 (its CPU default); --precision bf16 trains posttrain with `model.dtype:
auto` on a CPU with fast bf16 (bf16-autocast update over fp32 master weights) and TRL with `bf16=True` (the
same), and is refused on a CPU without fast bf16. Neither side recomputes activations (TRL's GRPOConfig turns
gradient checkpointing on by default; it is turned off here). Every snapshot of both sides is evaluated by the
same command, so the evaluation's precision is the same for both curves.

Timings on a shared machine are inflated by the other processes: the per-step lines carry process CPU
seconds too.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # matching, provenance: also when this file is imported by path

from matching import (  # noqa: E402
    COMPUTE_NAMES,
    PRECISION_ARGUMENT,
    posttrain_model_dtype,
    require_bf16_autocast,
    update_autocast,
)
from matching import side as side_settings  # noqa: E402  (`side` is a loop variable below)

SIDES = ("posttrain", "trl")


@dataclass(frozen=True)
class Demo:
    """One agentic demo: its GRPO and SFT configs, held-out file, cold-start output, tool, task and environment."""

    config: Path
    sft_config: Path
    test_data: Path
    start: Path
    tool: str | None  # a function of posttrain.envs.builtin_tools, or None: the game's own tools
    task: str  # a posttrain.tasks name
    environment: str  # the posttrain.envs module whose SYSTEM_PROMPT opens an episode (unless the config sets one)
    environment_factory: str | None = None  # module:Class of a TRL environment both sides play (its own reward)


DEMOS = {
    "calculator": Demo(
        ROOT / "examples" / "agent_calculator.yaml",
        ROOT / "examples" / "agent_calculator_sft.yaml",
        ROOT / "examples" / "data" / "calculator" / "test.jsonl",
        ROOT / "runs" / "calculator-sft" / "final",
        "calculator",
        "multiplication",
        "posttrain.envs.calculator",
    ),
    "word_problems": Demo(
        ROOT / "examples" / "agent_word_problems.yaml",
        ROOT / "examples" / "agent_word_problems_sft.yaml",
        ROOT / "examples" / "data" / "word_problems" / "test.jsonl",
        ROOT / "runs" / "word-problems-sft" / "final",
        "calculate",
        "word_problems",
        "posttrain.envs.word_problems",
    ),
    "guess_number_tools": Demo(
        ROOT / "examples" / "agent_guess_number_tools.yaml",
        ROOT / "examples" / "agent_guess_number_tools_sft.yaml",
        ROOT / "examples" / "data" / "guess_number" / "test.jsonl",
        ROOT / "runs" / "guess-number-tools-sft" / "final",
        None,
        "guess_number",
        "posttrain.envs.guess_number_tools",
        "posttrain.envs.guess_number_tools:GuessNumberGame",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="training wall time of each side (default 30)")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems per evaluation (default 200)")
    parser.add_argument("--points", type=int, default=6, help="snapshots per side, evenly over --minutes (default 6)")
    parser.add_argument("--task", choices=tuple(DEMOS), default="calculator", help="which demo (default calculator)")
    parser.add_argument("--start", type=Path, default=None, help="the weights both start from (default: the demo's)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "agent_vs_trl", help="snapshots and curves")
    parser.add_argument("--only", choices=SIDES, default=None, help="train one side only")
    parser.add_argument("--precision", **PRECISION_ARGUMENT)
    parser.add_argument("--dry-run", action="store_true", help="print the settings and commands, run nothing")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if not 1 <= args.eval_size <= 200:
        parser.error(f"--eval-size must be in 1..200 (the held-out file's rows), got {args.eval_size}")
    if args.points < 1:
        parser.error(f"--points must be >= 1, got {args.points}")
    args.demo = DEMOS[args.task]
    args.start = args.start or args.demo.start
    return args


def shared_settings(demo: Demo) -> dict[str, Any]:
    """What both sides take from the demo's config."""
    from posttrain.config import load_config
    from posttrain.trainers.rl.config import GRPOConfig

    cfg = load_config(GRPOConfig, demo.config)
    return {
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_tokens": cfg.rollout.max_tokens,
        "max_turns": cfg.env.max_turns,
        "max_episode_tokens": cfg.env.max_episode_tokens,
        "temperature": cfg.rollout.temperature,
        "lr": cfg.optim.lr,
        "seed": cfg.train.seed,
        "data_seed": cfg.data.seed,
        "system_prompt": cfg.env.options.get("system_prompt"),  # None: the environment module's SYSTEM_PROMPT
        "env_options": {k: v for k, v in cfg.env.options.items() if k != "system_prompt"},
        "task_options": dict(cfg.data.task_options),  # e.g. word_problems' operation_weights: the same mix of draws
        # the environment's per-step reward, when the config adds it to the outcome (word_problems' step_reward)
        "step_reward": cfg.env.options.get("step_reward", 0.0) if cfg.env.turn_rewards == "sum" else 0.0,
    }


def posttrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain", *args]


def eval_command(demo: Demo, model: Path, eval_size: int) -> list[str]:
    return posttrain_command(
        "eval", "accuracy", "--config", str(demo.config), "--model", str(model), "--data", str(demo.test_data),
        "--num", str(eval_size), "--json",
    )  # fmt: skip


def cold_start(args: argparse.Namespace) -> Path:
    """`--start`, trained first by the SFT config when it does not exist."""
    if (args.start / "config.json").is_file():
        return args.start
    run_dir = args.out / "sft"
    print(f"no {args.start}: running the cold start into {run_dir}", flush=True)
    subprocess.run(posttrain_command("sft", str(args.demo.sft_config), f"out={run_dir}"), check=True, cwd=ROOT)
    return run_dir / "final"


class Snapshots:
    """Saves the model at evenly spaced points of a side's training time: `due(elapsed)` says when."""

    def __init__(self, out: Path, minutes: float, points: int) -> None:
        self.out, self.every_s = out, minutes * 60 / points
        self.saved: list[dict[str, Any]] = []

    def due(self, elapsed_s: float) -> bool:
        return elapsed_s >= self.every_s * (len(self.saved) + 1)

    def record(self, path: Path, elapsed_s: float, step: int) -> None:
        self.saved.append({"path": str(path), "minutes": round(elapsed_s / 60, 3), "step": step})
        print(f"snapshot {path} at {elapsed_s / 60:.2f} min, step {step}", flush=True)


def train_posttrain(start: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """posttrain's GRPO on the demo's config from `start`, in this process, for --minutes."""
    from posttrain.checkpoint.model import save_trained
    from posttrain.config import load_config
    from posttrain.trainers.rl import rl_step, setup_run
    from posttrain.trainers.rl.config import GRPOConfig

    out = args.out / "posttrain"
    overrides = [f"model.name_or_path={start}", f"out={out}", "data.eval_size=0", "log.progress=false"]
    overrides.append(f"model.dtype={posttrain_model_dtype(args.precision)}")
    cfg = load_config(GRPOConfig, args.demo.config, overrides + ["kl.beta=0.0"])
    run = setup_run(cfg, "grpo")
    require_bf16_autocast(args.precision, update_autocast(run))
    snapshots = Snapshots(out, args.minutes, args.points)
    trained_s, step = 0.0, 0
    try:
        while trained_s < args.minutes * 60:
            step += 1
            start_s, cpu = time.perf_counter(), time.process_time()
            metrics = rl_step(run, step)
            trained_s += time.perf_counter() - start_s
            print(
                f"posttrain step {step}: {metrics['time/step_s']:.1f}s (cpu {time.process_time() - cpu:.1f}s) "
                f"reward={metrics['reward/mean']:.3f} tool_calls={metrics.get('env/tool_calls', 0):.2f} "
                f"turns={metrics.get('env/turns', 0):.2f} peak_rss={metrics.get('memory/peak_rss_gb', 0):.1f}GB "
                f"elapsed={trained_s / 60:.2f} min load={load_average()}",
                flush=True,
            )
            if snapshots.due(trained_s) or trained_s >= args.minutes * 60:
                path = save_trained(
                    run.model, run.tokenizer, out / f"snapshot-{len(snapshots.saved) + 1}", base_model=str(start)
                )
                snapshots.record(path, trained_s, step)
    finally:
        if run.logger is not None:
            run.logger.close()
    return snapshots.saved


def step_rewards(completions: list[list[dict]], step_reward: float, start: list, chain: list) -> list[float]:
    """The word_problems environment's process reward on TRL's completions: `step_reward` for each tool answer
    that is the chain's next intermediate value, in order (posttrain.envs.word_problems.steps_matched)."""
    from posttrain.envs.word_problems import intermediate_values, steps_matched

    rewards = []
    for messages, first, steps in zip(completions, start, chain, strict=True):
        results = [str(m.get("content")) for m in messages if m.get("role") == "tool"]
        rewards.append(step_reward * steps_matched(results, intermediate_values({"start": first, "chain": steps})))
    return rewards


def reward_functions(step_reward: float) -> list:
    """TRL's reward_funcs: the outcome, plus the per-step reward where the demo's config adds it (TRL sums them)."""
    if not step_reward:
        return [final_answer_reward]

    def correct_steps(completions: list[list[dict]], start: list, chain: list, **kwargs: Any) -> list[float]:
        return step_rewards(completions, step_reward, start, chain)

    return [final_answer_reward, correct_steps]


def final_answer_reward(completions: list[list[dict]], answer: list[str], **kwargs: Any) -> list[float]:
    """Both environments' reward on TRL's conversational completions: 1.0 when the last message is an assistant
    turn without tool calls whose last number is the exact answer (posttrain.envs.calculator.exact_final_number)."""
    from posttrain.envs.calculator import exact_final_number

    rewards = []
    for messages, reference in zip(completions, answer, strict=True):
        last = messages[-1] if messages else {}
        final = last.get("role") == "assistant" and not last.get("tool_calls")
        rewards.append(
            float(exact_final_number(str(last.get("content") or ""), {"answer": reference}) or 0.0) if final else 0.0
        )
    return rewards


def trl_rows(demo: Demo, settings: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """Fresh training problems of the demo's task, opened as its environment opens them (its system prompt)."""
    import importlib

    from posttrain.tasks import make_task

    prompt = settings.get("system_prompt") or importlib.import_module(demo.environment).SYSTEM_PROMPT
    system = {"role": "system", "content": prompt}
    rows = make_task(demo.task, seed=settings["data_seed"], **settings["task_options"]).sample(count)
    # the prompt opened as the environment opens it; the other columns reach the reward functions (TRL's kwargs)
    return [{**r, "prompt": [system, *r["prompt"]]} for r in rows]


def train_trl(start: Path, args: argparse.Namespace, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """TRL's GRPOTrainer with the demo's tool from `start`, for --minutes of training time."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer, chat_template_utils

    from posttrain.envs import builtin_tools
    from posttrain.imports import load_object
    from posttrain.trainers.rl.metrics import peak_memory_gb

    out = args.out / "trl"
    model = AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(start))  # its chat template is chatml_tools
    # TRL recognises tool-call formats by the template's exact text; ours writes Qwen's / Hermes' blocks, so
    # hand it that parser (what add_response_schema would set for a Qwen template).
    if chat_template_utils._SUPPORTS_RESPONSE_TEMPLATE:
        tokenizer.response_template = chat_template_utils.qwen3_template
    else:
        tokenizer.response_schema = chat_template_utils.qwen3_schema
    snapshots = Snapshots(out, args.minutes, args.points)

    class Clock(TrainerCallback):
        """Training time (snapshots and step lines excluded), snapshots when due, the stop at --minutes."""

        def __init__(self) -> None:
            self.trained_s = 0.0
            self.start = self.cpu = 0.0

        def on_step_begin(self, targs, state, control, **kwargs):  # noqa: ANN001
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, targs, state, control, **kwargs):  # noqa: ANN001
            took = time.perf_counter() - self.start
            self.trained_s += took
            print(
                f"trl step {state.global_step}: {took:.1f}s (cpu {time.process_time() - self.cpu:.1f}s) "
                f"peak_rss={peak_memory_gb(torch.device('cpu'))['memory/peak_rss_gb']:.1f}GB "
                f"elapsed={self.trained_s / 60:.2f} min load={load_average()}",
                flush=True,
            )
            done = self.trained_s >= args.minutes * 60
            if snapshots.due(self.trained_s) or done:
                path = out / f"snapshot-{len(snapshots.saved) + 1}"
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)
                snapshots.record(path, self.trained_s, state.global_step)
            control.should_training_stop = done

        def on_log(self, targs, state, control, logs=None, **kwargs):  # noqa: ANN001
            keep = ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length")
            print(f"trl log: { {k: round(v, 3) for k, v in (logs or {}).items() if k in keep} }", flush=True)

    trl_args = TRLConfig(
        output_dir=str(out),
        # one optimizer step on prompts x samples episodes, as posttrain's; its backward one prompt's group at a
        # time (TRL generates the whole step's batch at once either way): the batch's logits in one piece (32
        # episodes x ~800 tokens x 49k vocabulary in fp32) do not fit in 24 GiB
        per_device_train_batch_size=settings["samples_per_prompt"],
        gradient_accumulation_steps=settings["prompts_per_step"],
        num_generations=settings["samples_per_prompt"],
        max_completion_length=settings["max_episode_tokens"],
        max_tool_calling_iterations=settings["max_turns"] - 1,
        temperature=settings["temperature"],
        beta=0.0,
        num_iterations=1,
        learning_rate=settings["lr"],
        loss_type="grpo",
        max_steps=1_000_000,  # the clock stops it
        use_cpu=True,
        bf16=args.precision == "bf16",  # autocast over the fp32 weights, as posttrain's model.dtype=auto
        gradient_checkpointing=False,  # GRPOConfig's default is True; posttrain does not recompute either
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=settings["seed"],
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
    )
    rows = trl_rows(args.demo, settings, settings["prompts_per_step"] * 2000)
    if args.demo.environment_factory:  # the game's tools and reward (get_reward), built as the config builds it
        game = load_object(args.demo.environment_factory, "environment", ValueError)
        agent: dict[str, Any] = {"environment_factory": functools.partial(game, **settings["env_options"])}
    else:
        agent = {
            "tools": [getattr(builtin_tools, args.demo.tool)],
            "reward_funcs": reward_functions(settings["step_reward"]),
        }
    trainer = GRPOTrainer(
        model=model,
        args=trl_args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
        **agent,
    )
    trainer.train()
    return snapshots.saved


def evaluate(demo: Demo, model: Path, eval_size: int) -> dict[str, Any]:
    """posttrain's held-out evaluation with the tool: accuracy, tool calls and turns per episode."""
    started = time.perf_counter()
    done = subprocess.run(eval_command(demo, model, eval_size), capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"evaluating {model} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    figures = {
        "accuracy": result["accuracy"],
        "tool_calls_per_episode": result.get("env/tool_calls"),
        "turns_per_episode": result.get("env/turns"),
        "parse_failures": result.get("env/parse_failures"),
    }
    print(f"eval {model}: {figures} ({time.perf_counter() - started:.0f}s)", flush=True)
    return figures


def write_curves(out: Path, curves: dict[str, list[dict[str, Any]]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.json").write_text(json.dumps(curves, indent=2) + "\n", encoding="utf-8")
    fields = ["side", "minutes", "step", "accuracy", "tool_calls_per_episode", "turns_per_episode", "parse_failures"]
    with open(out / "curves.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for side, points in curves.items():
            for point in points:
                writer.writerow({"side": side, **point})


def summary(curves: dict[str, list[dict[str, Any]]], start: Path, args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "task": args.task,
        "minutes": args.minutes,
        "eval_size": args.eval_size,
        "start": str(start),
        "precision": args.precision,
        "sides": sides_record(args.precision, list(curves)),
    }
    for side, points in curves.items():
        result[side] = {key: points[-1].get(key) for key in ("minutes", "step", "accuracy", "tool_calls_per_episode")}
    ours, theirs = (result.get(side, {}).get("accuracy") for side in SIDES)
    if ours is not None and theirs is not None:
        result["accuracy_ratio"] = round(ours / theirs, 3) if theirs else None
    result["load_after"] = load_average()
    return result


def sides_record(precision: str, sides: list[str]) -> dict[str, dict[str, object]]:
    """Each trained side's compute dtype, threads, recomputation and package versions, for the JSON line."""
    import torch

    packages = {"posttrain": ("posttrain",), "trl": ("transformers", "trl")}
    return {name: side_settings(COMPUTE_NAMES[precision], torch.get_num_threads(), packages[name]) for name in sides}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = shared_settings(args.demo)
    sides = [args.only] if args.only else list(SIDES)
    if args.dry_run:
        plan = {
            "settings": settings,
            "sides": sides,
            "precision": args.precision,
            "posttrain_model_dtype": posttrain_model_dtype(args.precision),
            "start": str(args.start),
            "cold_start": None
            if (args.start / "config.json").is_file()
            else posttrain_command("sft", str(args.demo.sft_config)),
            "snapshot_every_min": args.minutes / args.points,
            "eval": eval_command(args.demo, args.start, args.eval_size),
        }
        print(json.dumps(plan))
        return
    start = cold_start(args)
    first = {"minutes": 0.0, "step": 0, **evaluate(args.demo, start, args.eval_size)}
    saved = {
        side: (train_posttrain(start, args) if side == "posttrain" else train_trl(start, args, settings))
        for side in sides
    }
    curves = {
        side: [first] + [{**s, **evaluate(args.demo, Path(s["path"]), args.eval_size)} for s in saved[side]]
        for side in sides
    }
    write_curves(args.out, curves)
    print(json.dumps(summary(curves, start, args)))


if __name__ == "__main__":
    main()

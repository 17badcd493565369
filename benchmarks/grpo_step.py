"""GRPO step time: posttrain vs TRL's GRPOTrainer on one configuration, in one run.

Both: the default model (SmolLM2-135M-Instruct, full fine-tuning), the same arithmetic prompts
(`ArithmeticTask(seed=0).sample(8)` per step, in order), 8 prompts x 8 samples, 32 new tokens at most,
temperature 1, beta 0 (no reference model), one optimizer step per rollout, AdamW at the same LR, the
`grpo` loss (per-sequence token mean), the `numeric_match` reward. TRL runs offline from the local HF
directory of the default model and an in-memory `datasets.Dataset`.

The two run alternately in one process, outside each other's timing: posttrain's steps after TRL's in odd
steps, before it in even ones, so that both see the same load on a shared machine and neither always goes
first. Prints per-step times, then one JSON line:
    {"posttrain_s": median step, "trl_s": median step, "speedup": trl_s / posttrain_s, "per_step": {...}, ...}
with the median process CPU seconds per step too (`*_cpu_s`, `speedup_cpu`): on a shared machine
they say more about the code than wall time does. `per_step` and `per_step_full` are the medians and the spread
of the per-step ratios (benchmarks/alternation.py; above 1: posttrain faster).

posttrain runs twice side by side: with its defaults (`posttrain_s`: groups whose advantages are all
zero are left out of the update, which does not change the weights) and with that skip turned off
(`posttrain_full_s`, `speedup_full`: every sample through the update, as TRL does), so the
ratio with the same work per step is reported too.

Precision is the same on both sides (benchmarks/matching.py): --precision fp32 (default) runs posttrain with
`model.dtype: float32` (fp32 rollouts and update) and TRL in fp32 (its CPU default); --precision bf16 runs
posttrain with `model.dtype: auto` on a CPU with fast bf16 (bf16 rollouts, bf16-autocast update over fp32 master
weights) and TRL with `bf16=True` (bf16 autocast; its generation then runs in bf16 too). TRL's GRPOConfig turns
gradient checkpointing on by default; here it is off, as posttrain does not recompute activations either. The
JSON names each side's compute dtype, threads, checkpointing and versions (`sides`) and the machine
(`environment`).

    .venv/bin/python benchmarks/grpo_step.py [--steps 4] [--only posttrain|trl] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from alternation import ratio_summary
from matching import (
    COMPUTE_NAMES,
    PRECISION_ARGUMENT,
    posttrain_model_dtype,
    require_bf16_autocast,
    side,
    update_autocast,
)
from provenance import environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS, SAMPLES, MAX_TOKENS, LR, SEED = 8, 8, 32, 1e-5, 0


def prompt_batches(steps: int) -> list[list[dict]]:
    from posttrain.tasks import ArithmeticTask

    task = ArithmeticTask(seed=SEED)
    return [task.sample(PROMPTS) for _ in range(steps)]


def setup_posttrain(out: Path, skip_zero_advantage: bool = True, dtype: str = "auto"):
    from posttrain.config import load_config
    from posttrain.trainers.rl import setup_run
    from posttrain.trainers.rl.config import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        None,
        [
            "algorithm=grpo",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.samples_per_prompt={SAMPLES}",
            f"rollout.max_tokens={MAX_TOKENS}",
            "rollout.temperature=1.0",
            "kl.beta=0.0",
            "train.epochs=1",
            f"optim.lr={LR}",
            "optim.max_grad_norm=1.0",
            "optim.betas=[0.9, 0.999]",
            "data.task=arithmetic",
            f"data.seed={SEED}",
            "data.eval_size=0",
            f"train.seed={SEED}",
            "log.progress=false",
            f"out={out}",
            "save_final=false",
            f"train.skip_zero_advantage={str(skip_zero_advantage).lower()}",
            f"model.dtype={dtype}",
        ],
    )
    return setup_run(cfg, "grpo")  # its ArithmeticTask(seed=0) draws the same prompts as prompt_batches()


def posttrain_step(run, times: list[float], cpu_times: list[float], label: str = "posttrain") -> None:  # noqa: ANN001
    from posttrain.trainers.rl import rl_step

    start, cpu = time.perf_counter(), time.process_time()
    metrics = rl_step(run, len(times) + 1)
    times.append(time.perf_counter() - start)
    cpu_times.append(time.process_time() - cpu)
    split = {k[5:-2]: round(v, 1) for k, v in metrics.items() if k.startswith("time/") and k != "time/step_s"}
    print(
        f"{label} step {len(times)}: {times[-1]:.1f}s (cpu {cpu_times[-1]:.1f}s) {split} "
        f"reward={metrics['reward/mean']:.3f} skipped_groups={metrics.get('update/skipped_group_frac', 0):.2f} "
        f"load={load_average()}",
        flush=True,
    )


def run_trl(steps: int, out: Path, between_steps=None, bf16: bool = False) -> tuple[list[float], list[float]]:  # noqa: ANN001
    """TRL's GRPOTrainer for `steps` steps; `between_steps()` runs after TRL's step in odd steps (1st, 3rd, ...) and
    before it in even ones, outside its timing."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from posttrain.models.hub import resolve_model_path
    from posttrain.rewards import numeric_match

    path = str(resolve_model_path("smollm2-135m"))
    rows = [row for batch in prompt_batches(steps) for row in batch]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.start = self.cpu_start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            if between_steps is not None and len(self.times) % 2 == 1:
                between_steps()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            self.times.append(time.perf_counter() - self.start)
            self.cpu_times.append(time.process_time() - self.cpu_start)
            print(
                f"trl step {len(self.times)}: {self.times[-1]:.1f}s (cpu {self.cpu_times[-1]:.1f}s) "
                f"load={load_average()}",
                flush=True,
            )
            if between_steps is not None and len(self.times) % 2 == 1:
                between_steps()

    args = TRLConfig(
        output_dir=str(out),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=MAX_TOKENS,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=LR,
        loss_type="grpo",
        max_steps=steps,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=bf16,
        gradient_checkpointing=False,  # GRPOConfig's default is True; posttrain does not recompute either
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=SEED,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=numeric_match,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    return timer.times, timer.cpu_times


def _posttrain_dtypes(run) -> str:  # noqa: ANN001
    """What the run computes in: the engine's dtype, and the update's (autocast over the master weights)."""
    update = update_autocast(run) or run.model.dtype
    rollout = str(run.llm.compute_dtype).removeprefix("torch.")
    return f"rollout {rollout}, update {str(update).removeprefix('torch.')}"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per framework (median over them; >= 3)")
    parser.add_argument("--only", choices=("posttrain", "trl"), default=None)
    parser.add_argument("--precision", **PRECISION_ARGUMENT)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the median of fewer is not a step time)")
    threads = torch.get_num_threads()
    compute = COMPUTE_NAMES[args.precision]
    result: dict[str, object] = {"benchmark": "grpo_step", "precision": args.precision, "load_before": load_average()}
    result["sides"] = {"posttrain": side(compute, threads), "trl": side(compute, threads, ("transformers", "trl"))}
    # label -> (step times, CPU times); "posttrain" with its defaults, "posttrain_full" computing every group
    ours: dict[str, tuple[list[float], list[float]]] = {"posttrain": ([], []), "posttrain_full": ([], [])}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        if args.only != "trl":
            dtype = posttrain_model_dtype(args.precision)
            runs = {label: setup_posttrain(Path(tmp) / label, label == "posttrain", dtype) for label in ours}
            first = next(iter(runs.values()))
            require_bf16_autocast(args.precision, update_autocast(first))
            result["posttrain_dtype"] = _posttrain_dtypes(first)

        def posttrain_steps() -> None:
            for label, run in runs.items():
                posttrain_step(run, *ours[label], label=label)

        if args.only == "posttrain":
            for _ in range(args.steps):
                posttrain_steps()
        else:
            # Alternate the frameworks (posttrain steps after each TRL step) so all see the same machine load.
            bf16 = args.precision == "bf16"
            trl, trl_cpu = run_trl(args.steps, Path(tmp) / "trl", posttrain_steps if runs else None, bf16)
            result["trl_dtype"] = "bfloat16 autocast" if bf16 else "float32"
            result["trl_s"] = round(statistics.median(trl), 2)
            result["trl_steps_s"] = [round(t, 2) for t in trl]
            result["trl_cpu_s"] = round(statistics.median(trl_cpu), 2)
        for label, run in runs.items():
            times, cpu_times = ours[label]
            result[f"{label}_s"] = round(statistics.median(times), 2)
            result[f"{label}_steps_s"] = [round(t, 2) for t in times]
            result[f"{label}_cpu_s"] = round(statistics.median(cpu_times), 2)
            run.logger.close()
    if "posttrain_s" in result and "trl_s" in result:
        for label, suffix in (("posttrain", ""), ("posttrain_full", "_full")):
            result[f"speedup{suffix}"] = round(result["trl_s"] / result[f"{label}_s"], 2)
            # process CPU seconds per step: less sensitive to what else the machine runs than wall time
            result[f"speedup{suffix}_cpu"] = round(result["trl_cpu_s"] / result[f"{label}_cpu_s"], 2)
            # per-step ratios: step k of each side draws the same prompts
            result[f"per_step{suffix}"] = ratio_summary(ours[label][0], trl, higher_is_better=False, digits=2)
    else:
        for name in ("posttrain", "trl"):
            if args.only == name:
                del result["sides"]["trl" if name == "posttrain" else "posttrain"]
    result["environment"] = environment()
    result["load_after"] = load_average()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

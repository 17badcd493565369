"""SFT throughput: posttrain's SFT step against TRL's `SFTTrainer`, same data, same settings, one run.

Both train the default model (SmolLM2-135M-Instruct) on the same GSM8K rows as conversational
prompt/completion pairs (question -> user turn, answer -> assistant turn), completion-only loss, no
packing, the same batches in the same order, AdamW lr 1e-5 constant, clipping at 1.0, no gradient
checkpointing on either side. The benchmark checks that both tokenize every row to the same ids.

Precision is the same on both sides (benchmarks/matching.py): --precision fp32 (default) runs posttrain with
`model.dtype: float32` and TRL in fp32; --precision bf16 runs both with fp32 master weights and bf16 autocast
(posttrain `model.dtype: auto` on a CPU with fast bf16, TRL `bf16=True`). The JSON line names each side's
compute dtype, threads, checkpointing and versions (`sides`), and the machine (`environment`).

The two alternate step by step on the same batch (`start_sft(cfg).step`, the step `train_sft` runs, called
from a TRL callback): TRL then posttrain in even steps, posttrain then TRL in odd ones, so load from other
processes on a shared machine falls on both alike and neither always goes first. The first step of each is a
warm-up and is not timed. Throughput is real (non-padding) tokens per second of training step (forward,
backward, clipping, optimizer), summed over the timed steps (`ratio`); `per_step` holds the medians of the
per-step rates and the spread of the per-step ratios (benchmarks/alternation.py); `cpu_time_ratio` is the
summed ratio in process CPU time, steadier than wall time on a busy machine.

    python benchmarks/sft.py                      # defaults below; prints one JSON line at the end
    python benchmarks/sft.py --batch 4 --steps 4 --threads 1
    python benchmarks/sft.py --precision bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from alternation import ratio_summary
from matching import COMPUTE_NAMES, PRECISION_ARGUMENT, posttrain_model_dtype, require_bf16_autocast, side
from provenance import environment

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(GSM8K))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="timed steps, >= 2 (after one warm-up step)")
    parser.add_argument("--precision", **PRECISION_ARGUMENT)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (each side goes first at least once)")
    return args


def load_rows(path: Path, count: int) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == count:
                break
    return rows


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)  # keep the output to the result lines

    from posttrain.config import load_config
    from posttrain.data.config import DataConfig
    from posttrain.data.dataset import build_sft_rows
    from posttrain.models.hub import load_tokenizer, resolve_model_path
    from posttrain.trainers.sft import SFTConfig, start_sft

    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    needed = args.batch * (args.steps + 1)
    work = Path(tempfile.mkdtemp(prefix="bench-sft-"))

    # The rows both sides train on: the first ones of GSM8K that fit max_length, in posttrain's batch order.
    raw = load_rows(Path(args.data), needed + 64)
    data_file = work / "rows.jsonl"
    data_file.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in raw))
    data_cfg = DataConfig(
        path=str(data_file),
        columns={"prompt": "question", "completion": "answer"},
        as_chat=True,
        max_length=args.max_length,
        max_bad_row_fraction=1.0,
    )
    tokenized = build_sft_rows(data_cfg, tokenizer)
    bad_lines = {int(b.location.rsplit(":", 1)[1]) for b in tokenized.bad_rows}
    kept = [r for i, r in enumerate(raw, start=1) if i not in bad_lines][:needed]
    rows = tokenized.rows[:needed]
    if len(rows) < needed:
        raise SystemExit(f"only {len(rows)} rows fit max_length {args.max_length}; need {needed}")
    data_file.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in kept))
    order = list(range(needed))
    random.Random(args.seed).shuffle(order)  # epoch 0 of posttrain's batch_stream(seed)
    batches = [order[i : i + args.batch] for i in range(0, needed, args.batch)]
    step_tokens = [sum(len(rows[i]) for i in batch) for batch in batches]
    padded_tokens = [len(batch) * max(len(rows[i]) for i in batch) for batch in batches]

    # ---- TRL
    import transformers
    from datasets import Dataset
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    transformers.logging.set_verbosity_error()
    trl_dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": kept[i]["question"]}],
                "completion": [{"role": "assistant", "content": kept[i]["answer"]}],
            }
            for i in order
        ]
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    total_steps = args.steps + 1  # the first step of each side is a warm-up, not timed
    trl_args = TRLConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=total_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_length=args.max_length,
        packing=False,
        completion_only_loss=True,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        shuffle_dataset=False,
        pad_to_multiple_of=None,
        bf16=args.precision == "bf16",
        fp16=False,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
        dataloader_pin_memory=False,
    )
    ours_cfg = load_config(
        SFTConfig,
        overrides=[
            f"model.name_or_path={model_dir}",
            f"data.path={data_file}",
            "data.columns={prompt: question, completion: answer}",
            "data.as_chat=true",
            f"data.max_length={args.max_length}",
            f"train.batch_size={args.batch}",
            f"train.max_steps={total_steps}",
            f"train.seed={args.seed}",
            f"optim.lr={args.lr}",
            "optim.schedule=constant",
            "optim.weight_decay=0.0",
            "optim.max_grad_norm=1.0",
            "train.progress=false",
            f"model.dtype={posttrain_model_dtype(args.precision)}",
            f"out={work / 'ours'}",
        ],
    )
    session = start_sft(ours_cfg)
    require_bf16_autocast(args.precision, session_autocast(session))
    times: dict[str, list[float]] = {"posttrain": [], "trl": []}
    cpu_times: dict[str, list[float]] = {"posttrain": [], "trl": []}
    ours_losses: list[float] = []

    class Interleave(transformers.TrainerCallback):
        """Times each TRL step and runs (and times) posttrain's step on the same batch: after TRL's in even steps,
        before it in odd ones."""

        def on_step_begin(self, *a, **k):
            if len(times["trl"]) % 2 == 1:
                self.posttrain_step()
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times["trl"].append(time.perf_counter() - self.wall)
            cpu_times["trl"].append(time.process_time() - self.cpu)
            if len(times["trl"]) % 2 == 1:
                self.posttrain_step()

        def posttrain_step(self) -> None:
            index = len(times["posttrain"])
            wall, cpu = time.perf_counter(), time.process_time()
            record = session.step(index)
            times["posttrain"].append(time.perf_counter() - wall)
            cpu_times["posttrain"].append(time.process_time() - cpu)
            ours_losses.append(record["loss"])
            assert record["tokens"] == step_tokens[index], "posttrain trained on another batch than TRL"
            print(
                f"step {index + 1}/{total_steps}: posttrain {times['posttrain'][-1]:.1f} s, TRL {times['trl'][-1]:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    trainer = SFTTrainer(
        model=hf_model,
        args=trl_args,
        train_dataset=trl_dataset,
        processing_class=hf_tokenizer,
        callbacks=[Interleave()],
    )
    trl_ids = [list(ids) for ids in trainer.train_dataset["input_ids"]]
    identical = trl_ids == [rows[i].input_ids for i in order]
    trainer.train()
    trl_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    timed_tokens = sum(step_tokens[1:])
    rate = {side: timed_tokens / sum(t[1:]) for side, t in times.items()}
    cpu_rate = {side: timed_tokens / sum(t[1:]) for side, t in cpu_times.items()}
    threads = torch.get_num_threads()
    compute = COMPUTE_NAMES[args.precision]
    result = {
        "benchmark": "sft",
        "model": args.model,
        "precision": args.precision,
        "batch": args.batch,
        "max_length": args.max_length,
        "timed_steps_each": args.steps,
        "tokens_per_step": round(timed_tokens / args.steps, 1),
        "padded_tokens_per_step": round(sum(padded_tokens[1:]) / args.steps, 1),
        "identical_token_ids": identical,
        "first_step_loss": {
            "posttrain": round(ours_losses[0], 5),
            "trl": round(trl_losses[0], 5) if trl_losses else None,
        },
        "posttrain_tokens_per_s": round(rate["posttrain"], 2),
        "trl_tokens_per_s": round(rate["trl"], 2),
        "ratio": round(rate["posttrain"] / rate["trl"], 3),
        "cpu_time_ratio": round(cpu_rate["posttrain"] / cpu_rate["trl"], 3),
        "per_step": per_step_rates(step_tokens[1:], times["posttrain"][1:], times["trl"][1:]),
        "sides": {
            "posttrain": side(compute, threads),
            "trl": side(compute, threads, ("transformers", "trl")),
        },
        "environment": environment(),
    }
    print(json.dumps(result))
    return 0


def per_step_rates(tokens: list[int], ours_s: list[float], theirs_s: list[float]) -> dict:
    """Tokens/s of each timed step on each side (the same batch on both), summarized as medians and ratio spread."""
    ours = [n / t for n, t in zip(tokens, ours_s, strict=True)]
    theirs = [n / t for n, t in zip(tokens, theirs_s, strict=True)]
    return ratio_summary(ours, theirs, higher_is_better=True)


def session_autocast(session) -> torch.dtype | None:  # noqa: ANN001
    """The dtype posttrain's training forwards autocast to (None: the weights' own dtype)."""
    autocast = session.parallel.compute_autocast if session.parallel is not None else None
    return autocast[1] if autocast is not None else None


if __name__ == "__main__":
    sys.exit(main())

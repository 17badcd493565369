"""SFT throughput: posttrain's `train_sft` against TRL's `SFTTrainer`, same data, same settings, one run.

Both train the default model (SmolLM2-135M-Instruct, fp32) on the same GSM8K rows as conversational
prompt/completion pairs (question -> user turn, answer -> assistant turn), completion-only loss, no
packing, the same batches in the same order, AdamW lr 1e-5 constant, clipping at 1.0, no gradient
checkpointing (TRL's default turns it on; that would only slow TRL down). The benchmark checks that
both tokenize every row to the same ids.

The runs alternate (posttrain, TRL, posttrain, TRL, ...) so that load from other processes on a
shared machine falls on both; the first step of each block is a warm-up and not timed. Throughput
is real (non-padding) tokens per second of training step, summed over the timed steps.

    python benchmarks/sft.py                      # defaults below; prints one JSON line at the end
    python benchmarks/sft.py --batch 8 --steps 5 --threads 2
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

GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(GSM8K))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block (plus one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2, help="posttrain/TRL block pairs")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


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
    from posttrain.metrics import read_metrics
    from posttrain.models.hub import load_tokenizer, resolve_model_path
    from posttrain.trainers.sft import SFTConfig, train_sft

    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    steps_per_block = args.steps + 1
    needed = args.batch * steps_per_block
    work = Path(tempfile.mkdtemp(prefix="bench-sft-"))

    # The rows both sides train on: the first ones of GSM8K that fit max_length, in posttrain's batch order.
    raw = load_rows(Path(args.data), needed + 64)
    data_file = work / "rows.jsonl"
    data_file.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in raw))
    data_cfg = DataConfig(path=str(data_file), columns={"prompt": "question", "completion": "answer"}, as_chat=True,
                          max_length=args.max_length, max_bad_row_fraction=1.0)
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

    # ---- TRL
    import transformers
    from datasets import Dataset
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    transformers.logging.set_verbosity_error()
    trl_dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": kept[i]["question"]}],
         "completion": [{"role": "assistant", "content": kept[i]["answer"]}]} for i in order
    ])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trl_args = TRLConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        max_steps=steps_per_block, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_length=args.max_length, packing=False, completion_only_loss=True,
        gradient_checkpointing=False, train_sampling_strategy="sequential", shuffle_dataset=False,
        pad_to_multiple_of=None, bf16=False, fp16=False, use_cpu=True, save_strategy="no", report_to="none",
        logging_steps=10_000, disable_tqdm=True, seed=args.seed, dataloader_pin_memory=False,
    )
    step_times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.start)

    trainer = SFTTrainer(model=hf_model, args=trl_args, train_dataset=trl_dataset, processing_class=hf_tokenizer,
                         callbacks=[StepTimer()])
    trl_ids = [list(ids) for ids in trainer.train_dataset["input_ids"]]
    identical = trl_ids == [rows[i].input_ids for i in order]

    # ---- alternate blocks
    ours_cfg = load_config(SFTConfig, overrides=[
        f"model.name_or_path={model_dir}", f"data.path={data_file}", "data.columns={prompt: question, completion: answer}",
        "data.as_chat=true", f"data.max_length={args.max_length}", f"train.batch_size={args.batch}",
        f"train.max_steps={steps_per_block}", f"train.seed={args.seed}", f"optim.lr={args.lr}", "optim.schedule=constant",
        "optim.weight_decay=0.0", "optim.max_grad_norm=1.0", "train.progress=false",
    ])
    ours_time = trl_time = 0.0
    ours_tokens = trl_tokens = 0
    timed_tokens = sum(step_tokens[1:])
    for round_index in range(args.rounds):
        ours_cfg.out = str(work / f"ours-{round_index}")
        records = read_metrics(train_sft(ours_cfg))
        assert [r["tokens"] for r in records] == step_tokens, "posttrain trained on other batches than planned"
        ours_time += sum(r["step_time"] for r in records[1:])
        ours_tokens += timed_tokens
        step_times.clear()
        trainer.train()
        trl_time += sum(step_times[1:])
        trl_tokens += timed_tokens
        print(f"round {round_index + 1}: posttrain {ours_tokens / ours_time:.1f} tok/s, TRL {trl_tokens / trl_time:.1f} tok/s"
              " (cumulative)", file=sys.stderr, flush=True)

    ours_tps, trl_tps = ours_tokens / ours_time, trl_tokens / trl_time
    print(json.dumps({
        "benchmark": "sft", "model": args.model, "batch": args.batch, "max_length": args.max_length,
        "timed_steps_each": args.steps * args.rounds, "tokens_per_step": round(timed_tokens / args.steps, 1),
        "threads": torch.get_num_threads(), "identical_token_ids": identical,
        "posttrain_tokens_per_s": round(ours_tps, 2), "trl_tokens_per_s": round(trl_tps, 2),
        "ratio": round(ours_tps / trl_tps, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

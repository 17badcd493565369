"""On-policy distillation curve: student-teacher divergence on held-out prompts, before and during training.

    .venv/bin/python benchmarks/distill_curve.py        # 30 steps x 8 prompts x 32 new tokens, eval every 10 steps
    .venv/bin/python benchmarks/distill_curve.py --steps 2 --batch-size 2 --eval-prompts 4 --max-new-tokens 8 --eval-every 1

Teacher: smollm2-135m (30 decoder layers). Student: the teacher with every other layer kept (15 layers,
`posttrain convert --num-layers 15`, see posttrain/trainers/distill_student.py), the only smaller model
with the same tokenizer at hand. Training is `posttrain distill` with mode=on_policy: each step the student samples
--max-new-tokens for --batch-size GSM8K train questions (chat template) and is trained toward the teacher
on its own samples (--loss reverse_kl: KL(student || teacher) per token; jsd also works).

Held-out: the last --eval-prompts questions of the file, never trained on. Their completions are the
teacher's greedy continuations (--max-new-tokens, then the template's end of turn), generated once, so
every eval point scores the same tokens and the curve shows the student moving, not sampling noise. The
points are the trainer's own held-out evaluation (`eval_loss`, the --loss divergence per completion token)
at step 0 and every --eval-every steps.

Prints one JSON line per eval point as it is logged, then one JSON line with the whole curve. Progress
and the trainer's bar go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.cli import main as posttrain_cli  # noqa: E402
from posttrain.config import load_config  # noqa: E402
from posttrain.engine import LLM, SamplingParams  # noqa: E402
from posttrain.trainers.distill import DistillConfig, train_distill  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "train.jsonl"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--student-layers", type=int, default=15, help="evenly spaced layers kept (15 of 30: every other)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="prompts sampled per step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=10, help="steps between eval points (5: ~1.5 more minutes)")
    p.add_argument("--loss", default="reverse_kl", choices=["reverse_kl", "jsd", "forward_kl"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--data", type=Path, default=GSM8K)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "distill-curve")
    return p.parse_args()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def teacher_completions(teacher: str, questions: list[str], max_new_tokens: int) -> list[str]:
    """The teacher's greedy continuation of each question (as a one-turn chat)."""
    llm = LLM(teacher)
    outputs = llm.generate(
        [[{"role": "user", "content": q}] for q in questions],
        SamplingParams(temperature=0.0, max_tokens=max_new_tokens),
    )
    return [o.outputs[0].text for o in outputs]


class EvalFollower(threading.Thread):
    """Prints each held-out record of a metrics.jsonl as the trainer writes it (one JSON line each)."""

    def __init__(self, path: Path, start: float) -> None:
        super().__init__(daemon=True)
        self.path, self.started_at, self.seen, self.points = path, start, 0, []
        self.done = threading.Event()

    def poll(self) -> None:
        if not self.path.is_file():
            return
        text = self.path.read_text()
        complete = text[: text.rfind("\n") + 1].splitlines()  # a line still being written waits for the next poll
        for line in complete[self.seen :]:
            record = json.loads(line)
            if "eval_loss" in record:
                point = {
                    "step": record["step"],
                    "kl": record["eval_loss"],
                    "eval_tokens": record["eval_tokens"],
                    "train_loss": record.get("loss"),
                    "elapsed_s": round(time.perf_counter() - self.started_at, 1),
                }
                self.points.append(point)
                print(json.dumps(point), flush=True)
        self.seen = len(complete)

    def run(self) -> None:
        while not self.done.wait(2.0):
            self.poll()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    train_rows = rows[: args.steps * args.batch_size]  # one epoch: every prompt is sampled once
    held_rows = rows[-args.eval_prompts :]

    student = args.out / "student"
    log(f"deriving the student: {args.student_layers} evenly spaced layers of {args.teacher} -> {student}")
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON lines
        code = posttrain_cli(
            [
                "convert",
                "--model",
                args.teacher,
                "--out",
                str(student),
                "--num-layers",
                str(args.student_layers),
                "--force",
            ]
        )
    if code != 0:
        raise SystemExit("convert failed")
    log(f"teacher greedy completions for {len(held_rows)} held-out prompts")
    completions = teacher_completions(args.teacher, [r["question"] for r in held_rows], args.max_new_tokens)
    train_file = write_jsonl(
        args.out / "train.jsonl", [{"prompt": r["question"], "completion": r["answer"]} for r in train_rows]
    )  # on-policy: only the prompts are used
    eval_file = write_jsonl(
        args.out / "held_out.jsonl",
        [{"prompt": r["question"], "completion": c} for r, c in zip(held_rows, completions)],
    )

    run_dir = args.out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(
        DistillConfig,
        overrides=[
            f"model.name_or_path={student}",
            f"teacher.name_or_path={args.teacher}",
            f"data.path={train_file}",
            f"data.eval_path={eval_file}",
            "data.as_chat=true",
            "data.max_length=512",
            "mode=on_policy",
            f"loss={args.loss}",
            f"max_new_tokens={args.max_new_tokens}",
            f"train.max_steps={args.steps}",
            f"train.batch_size={args.batch_size}",
            f"train.eval_every={args.eval_every}",
            f"optim.lr={args.lr}",
            "optim.schedule=constant",
            "optim.warmup_steps=2",
            f"out={run_dir}",
        ],
    )
    follower = EvalFollower(run_dir / "metrics.jsonl", start)
    follower.start()
    try:
        train_distill(cfg)
    finally:
        follower.done.set()
        follower.join()
    follower.poll()  # the records written after the last poll

    config = json.loads((student / "config.json").read_text())
    curve = [[p["step"], p["kl"]] for p in follower.points]
    print(
        json.dumps(
            {
                "benchmark": "distill_curve",
                "teacher": args.teacher,
                "student_layers": config["num_hidden_layers"],
                "mode": "on_policy",
                "loss": args.loss,
                "steps": args.steps,
                "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens,
                "eval_prompts": len(held_rows),
                "lr": args.lr,
                "curve": curve,
                "kl_before": curve[0][1] if curve else None,
                "kl_after": curve[-1][1] if curve else None,
                "ratio_after_before": round(curve[-1][1] / curve[0][1], 4) if curve and curve[0][1] else None,
                "seconds": round(time.perf_counter() - start, 1),
                "run_dir": str(run_dir),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()

"""What every trainer does around its step, from the first batch's padding to the last evaluation.

    pad_id = pad_token_id(tokenizer, cfg.model.name_or_path)       what batches are padded with
    write_data_report(run_dir, report)                               <run>/data_report.json, by rank 0
    checkpointer, start_step = open_checkpointer("dpo", cfg, start, model, tokenizer, optimizer, scheduler,
                                                 parallel, state={...})    built, and restored when resuming
    last = train_and_evaluate(cfg, step_fn, checkpointer, start_step, max_steps, eval_fn, desc="dpo", report=log)

A trainer keeps what is its own (the data, the step, the loss, what its log lines say); these pieces hold
what would otherwise be written again in each of them. The final save is `adapters.save_final_parallel`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.checkpoint.resume import RunStart
from posttrain.checkpoint.state import Checkpointer, Stateful
from posttrain.data.validate import DataError
from posttrain.distributed.env import is_main
from posttrain.distributed.parallel import Parallel
from posttrain.distributed.processes import main_metrics
from posttrain.trainers.loop import StepFn, run_steps

Record = dict[str, float]


def pad_token_id(tokenizer: Any, model_name: str) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS token; a DataError naming the
    model when it has neither."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise DataError(f"{model_name}: the tokenizer has neither a pad nor an EOS token to pad with")
    return pad_id


def write_data_report(run_dir: Path, report: dict[str, Any]) -> None:
    """<run>/data_report.json: what was read, kept and skipped; written by rank 0 only."""
    if is_main():
        text = json.dumps(report, indent=1, ensure_ascii=False) + "\n"
        (run_dir / "data_report.json").write_text(text, encoding="utf-8")


def open_checkpointer(
    command: str,
    cfg: Any,
    start: RunStart,
    model: nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    parallel: Parallel | None,
    *,
    state: dict[str, Stateful],
    modules: dict[str, nn.Module] | None = None,
    write_extras: Callable[[Path], object] | None = None,
) -> tuple[Checkpointer, int]:
    """The run's Checkpointer (base model and kept checkpoints from `cfg.model` and `cfg.train`) and the step
    the run starts at: `start.checkpoint`'s, restored into the live objects, or 0 for a fresh run."""
    checkpointer = Checkpointer(
        command,
        start.run_dir,
        model,
        tokenizer,
        cfg.model.name_or_path,
        optimizer,
        scheduler,
        modules=modules or {},
        state=state,
        keep_last=cfg.train.keep_checkpoints,
        write_extras=write_extras,
        parallel=parallel,
    )
    start_step = checkpointer.restore(start.checkpoint) if start.checkpoint is not None else 0
    return checkpointer, start_step


def train_and_evaluate(
    cfg: Any,
    step_fn: StepFn,
    checkpointer: Checkpointer,
    start_step: int,
    max_steps: int,
    eval_fn: Callable[[], Record] | None,
    *,
    desc: str,
    postfix: dict[str, str] | None = None,
    report: Callable[[str, Record], None] | None = None,
) -> Record:
    """`run_steps` from `start_step` to `max_steps` at `cfg.train`'s cadence (records, checkpoints through
    `checkpointer`, evaluations with `eval_fn`), with rank 0's metrics (metrics.jsonl and `cfg.log`'s trackers)
    and its progress bar. Returns the last step's record.

    With `report` (and held-out data), a fresh run is evaluated before its first step, logged as step 0, and
    `report("before", record)` is told; after the last step `report("after", last record)`, which holds the
    final evaluation. Under torchrun every rank evaluates all held-out rows: every rank has the same figures."""
    train = cfg.train
    with main_metrics(checkpointer.run_dir, cfg) as metrics:
        if eval_fn is not None and report is not None and start_step == 0:
            first = eval_fn()
            if metrics is not None:
                metrics.log(0, first)
            report("before", first)
        last = run_steps(
            step_fn,
            max_steps=max_steps,
            optimizer=checkpointer.optimizer,
            metrics=metrics,
            log_every=train.log_every,
            save_every=train.save_every,
            eval_every=train.eval_every,
            eval_fn=eval_fn,
            save_fn=checkpointer.save,
            start_step=start_step,
            progress=train.progress and is_main(),
            desc=desc,
            postfix=postfix,
        )
        if eval_fn is not None and report is not None:
            report("after", last)
    return last

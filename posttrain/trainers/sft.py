"""Supervised fine-tuning: a config and a loop over the shared pieces.

The loss is the cross-entropy of the completion (assistant) tokens only, **averaged over all
completion tokens of the optimizer step**: every micro-batch's summed loss is divided by the number
of completion tokens across all `grad_accum` micro-batches. Each token then weighs the same whatever
the row lengths or the micro-batch split, so batch 8 and 2 x 4 accumulation give the same update
(TRL and transformers normalise the same way, via `num_items_in_batch`). The alternative, a mean of
per-row or per-micro-batch means, would up-weight the tokens of short answers.

Where the time goes, and what is saved: the LM head is applied only at positions that have a target
(prompt and padding positions are skipped), through `chunked_cross_entropy`, which never holds the
(tokens x vocab) logits; and each batch is cut into sub-batches of similar length (`length_groups`)
so the trunk computes few padding tokens. Neither changes the update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.algos.logprobs import chunked_cross_entropy
from posttrain.checkpoint.resume import open_run
from posttrain.checkpoint.state import Checkpointer
from posttrain.data.collate import Batch, collate, length_groups
from posttrain.data.config import DataConfig
from posttrain.data.dataset import build_sft_rows, split_holdout
from posttrain.data.packing import PackedRow, pack_best_fit
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import all_reduce_count, reduce_metrics
from posttrain.distributed.parallel import Parallel
from posttrain.distributed.processes import join_processes
from posttrain.models.moe import add_router_loss
from posttrain.models.transformer import Transformer
from posttrain.peft import LoraConfig
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.adapters import check_adapter_options, load_trainable, save_final_dir, save_final_parallel
from posttrain.trainers.faults import BadStepGuard
from posttrain.trainers.lifecycle import open_checkpointer, pad_token_id, train_and_evaluate, write_data_report
from posttrain.trainers.loop import batch_stream, seed_everything
from posttrain.trainers.optim import optimizer_for, optimizer_step
from posttrain.trainers.schedule import scheduler_for
from posttrain.trainers.sections import LogSection, ModelSection, OptimSection, TrainSection

logger = logging.getLogger("posttrain.trainers")

Unit = TokenizedRow | PackedRow  # what a batch holds: a row, or a packed row of several
ONE_GROUP = 1 << 40  # a length-group price no padding saving beats: each batch is one pass
SUMMED_METRICS = frozenset({"loss", "tokens"})  # each rank holds its part; the rest are equal on every rank


@dataclass
class SFTDataConfig(DataConfig):
    packing: bool = False  # best-fit pack rows into max_length rows with segment isolation
    completion_only_loss: bool = True  # False: train on every token, prompt included


@dataclass
class SFTTrainSection(TrainSection):
    # Each batch is cut into sub-batches of similar length when that saves more padded tokens than
    # this price per extra forward/backward pass (see posttrain.data.collate.length_groups); the update
    # is the same either way. null: 64 on CPU (a pass costs little next to a token), 4096 on GPUs.
    group_cost_tokens: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.group_cost_tokens is not None and self.group_cost_tokens < 0:
            raise ValueError(f"group_cost_tokens must be >= 0 or null, got {self.group_cost_tokens}")


@dataclass
class SFTConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    train: SFTTrainSection = field(default_factory=SFTTrainSection)
    log: LogSection = field(default_factory=LogSection)  # trackers besides metrics.jsonl: docs/tracking.md
    lora: LoraConfig | None = None  # train LoRA adapters only; final/ is then the PEFT adapter
    quant: str | None = None  # QLoRA: quantize the frozen base (int8, int4-g64, ...) under the adapters; needs lora
    qat: str | None = None  # quantization-aware training toward this scheme; final/ is the quantized model
    out: str | None = None  # the run directory; default runs/sft-<timestamp>
    resume: str | None = None  # auto (the newest checkpoint in out) or a checkpoint directory; see docs/resume.md
    dist: DistSection = field(default_factory=DistSection)  # torchrun data parallelism; see docs/distributed.md

    def validate(self) -> None:
        check_adapter_options(self.lora, self.quant, self.qat)
        if self.data.eval_fraction == 0 and not self.data.eval_path and self.train.eval_every:
            raise ValueError("train.eval_every is set but there is no eval data (data.eval_path or data.eval_fraction)")


# ----------------------------------------------------------------------------- the loss


def sft_loss_sum(model: Transformer, batch: Batch) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's targets (float32 scalar).

    Only the positions with a target go through the LM head, in row chunks (see chunked_cross_entropy).
    """
    hidden = model.hidden_states(batch.input_ids, **batch.model_kwargs())  # (B, T, d)
    keep = batch.targets != IGNORE_INDEX  # (B, T)
    if not isinstance(model.lm_head, nn.Linear):
        # LoRA on an (untied) lm_head: the adapter is part of the head, so it runs as a module and the
        # (N, V) logits are held; there is no bare weight to hand to the chunked loss.
        return F.cross_entropy(model.logits(hidden[keep]), batch.targets[keep], reduction="sum")
    return chunked_cross_entropy(hidden[keep], model.lm_head.weight, batch.targets[keep], reduction="sum")


def grouped_batches(units: list[Unit], pad_token_id: int, group_cost_tokens: int, device: torch.device) -> list[Batch]:
    """One batch of units as padded sub-batches of similar length (see `length_groups`)."""
    groups = length_groups([len(u) for u in units], group_cost_tokens)
    return [collate([units[i] for i in group], pad_token_id).to(device) for group in groups]


def default_group_cost(device: torch.device) -> int:
    return 64 if device.type == "cpu" else 4096


@torch.no_grad()
def evaluate(
    model: Transformer,
    units: list[Unit],
    batch_size: int,
    pad_token_id: int,
    group_cost_tokens: int | None = None,
    parallel: Parallel | None = None,
) -> dict[str, float]:
    """Token-mean loss over `units`, in the same units as the training loss.

    Under torchrun every rank evaluates all of `units` (the same forwards in the same order, which FSDP2's
    gathers need), so every rank holds the same figures without a reduction."""
    was_training = model.training
    model.eval()
    cost = default_group_cost(model.device) if group_cost_tokens is None else group_cost_tokens
    total, count = 0.0, 0
    for start in range(0, len(units), batch_size):
        for batch in grouped_batches(units[start : start + batch_size], pad_token_id, cost, model.device):
            total += float(parallel.run(sft_loss_sum, batch) if parallel is not None else sft_loss_sum(model, batch))
            count += batch.num_targets
    model.train(was_training)
    return {"eval_loss": total / max(count, 1), "eval_tokens": count}


# ----------------------------------------------------------------------------- the trainer


def load_sft_data(cfg: SFTConfig, tokenizer: Any) -> tuple[list[Unit], list[Unit], dict[str, Any]]:
    """(train units, eval units, a report of what was read and skipped)."""
    data = cfg.data
    train = build_sft_rows(data, tokenizer, completion_only=data.completion_only_loss)
    report: dict[str, Any] = {
        "path": data.path,
        "format": train.format,
        "rows_read": train.rows_read,
        "rows_kept": len(train.rows),
        "bad_rows": [vars(b) for b in train.bad_rows],
    }
    rows, eval_rows = split_holdout(train.rows, data.eval_fraction, cfg.train.seed)
    if data.eval_path:
        held = build_sft_rows(data, tokenizer, completion_only=data.completion_only_loss, path=data.eval_path)
        eval_rows = held.rows
        report["eval"] = {
            "path": data.eval_path,
            "rows_read": held.rows_read,
            "rows_kept": len(held.rows),
            "bad_rows": [vars(b) for b in held.bad_rows],
        }
    report["train_rows"], report["eval_rows"] = len(rows), len(eval_rows)
    if data.packing:
        units: tuple[list[Unit], list[Unit]] = (
            pack_best_fit(rows, data.max_length),
            pack_best_fit(eval_rows, data.max_length),
        )
        report["packed_rows"] = len(units[0])
        return units[0], units[1], report
    return list(rows), list(eval_rows), report


@dataclass
class SFTSession:
    """A prepared run: the model, data and optimizer, and `step(i)`, which does optimizer step i.

    `train_sft` is `start_sft` + `run_steps` + the final save; the session is public so a caller can
    drive the steps itself (a benchmark interleaving two trainers, a notebook)."""

    model: Transformer
    tokenizer: Any
    run_dir: Path
    units: list[Unit]
    eval_units: list[Unit]
    optimizer: torch.optim.Optimizer
    max_steps: int
    step: Callable[[int], dict[str, float]]
    evaluate: Callable[[], dict[str, float]] | None
    checkpointer: Checkpointer
    start_step: int = 0  # steps already done: > 0 when resumed from a checkpoint
    parallel: Parallel | None = None  # how the model is spread over torchrun's processes (strategy none: as is)


def start_sft(cfg: SFTConfig) -> SFTSession:
    """Load the model (with its adapters, quantized base or fake quantization) and data, create (or reopen,
    with `resume`) the run directory, build the optimizer and the step, and restore a checkpoint if resuming."""
    seed_everything(cfg.train.seed)
    ctx, model_section = join_processes(cfg.dist, cfg.model)
    model, tokenizer = load_trainable(model_section, lora=cfg.lora, quant=cfg.quant, qat=cfg.qat)
    model.train()
    # Before the optimizer: FSDP2 replaces the Parameters by shards.
    parallel = Parallel(model, cfg.dist, ctx, compute_dtype=model_section.autocast_dtype(model))
    parallel.check_divides("train.batch_size", cfg.train.batch_size)
    pad_id = pad_token_id(tokenizer, cfg.model.name_or_path)
    units, eval_units, report = load_sft_data(cfg, tokenizer)
    train_cfg, optim_cfg = cfg.train, cfg.optim
    max_steps = train_cfg.total_steps(len(units))
    start = open_run("sft", cfg)
    run_dir = start.run_dir
    write_data_report(run_dir, report)
    logger.info(
        "sft: %d rows of %s (%d bad, skipped) -> %d %s; %d steps of %d; run dir %s",
        report["rows_kept"],
        report["format"],
        len(report["bad_rows"]),
        len(units),
        "packed rows" if cfg.data.packing else "rows",
        max_steps,
        train_cfg.items_per_step,
        run_dir,
    )

    optimizer = optimizer_for(model, optim_cfg)
    scheduler = scheduler_for(optimizer, optim_cfg, max_steps)
    stream = batch_stream(units, train_cfg.batch_size, seed=train_cfg.seed)
    guard = BadStepGuard(train_cfg.max_bad_steps)
    device = model.device
    group_cost = default_group_cost(device) if train_cfg.group_cost_tokens is None else train_cfg.group_cost_tokens
    # Under torchrun each rank's share of a micro-batch is one pass: FSDP2 gathers every layer in lockstep, so
    # every rank must run the same number of forwards (length groups could differ from rank to rank).
    train_group_cost = ONE_GROUP if parallel.wrapped is not None else group_cost

    def step(index: int) -> dict[str, float]:
        # All micro-batches of the step (each cut into length groups) share one normaliser: the step's
        # completion-token count over every rank, so the update does not depend on how the rows were split.
        batches = [
            b
            for _ in range(train_cfg.grad_accum)
            for b in grouped_batches(parallel.shard(next(stream)), pad_id, train_group_cost, device)
        ]
        loss_tokens = int(all_reduce_count(sum(b.num_targets for b in batches), device))

        def loss_of(m: Transformer, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            # Mixture-of-experts models add the router's load-balancing loss and log router/* metrics.
            return add_router_loss(m, sft_loss_sum(m, b), b.attention_mask, b.num_targets, loss_tokens)

        def micro_loss(b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            loss_sum, router = parallel.run(loss_of, b)
            return loss_sum, {"tokens": b.num_tokens, **router}

        out = accumulate_gradients(batches, micro_loss, loss_tokens, parallel)
        out = reduce_metrics(out, SUMMED_METRICS, device)  # the step's loss and tokens over every rank
        grad_norm, applied = optimizer_step(optimizer, scheduler, optim_cfg.max_grad_norm, loss=out["loss"])
        guard.record(index + 1, applied, out["loss"], grad_norm)
        return {**out, "grad_norm": grad_norm, "loss_tokens": loss_tokens, "skipped_updates": guard.total}

    evaluate_fn = (
        (lambda: evaluate(model, eval_units, train_cfg.batch_size, pad_id, group_cost, parallel))
        if eval_units
        else None
    )
    state = {"data": stream, "faults": guard}
    checkpointer, start_step = open_checkpointer(
        "sft", cfg, start, model, tokenizer, optimizer, scheduler, parallel, state=state
    )
    return SFTSession(
        model,
        tokenizer,
        run_dir,
        units,
        eval_units,
        optimizer,
        max_steps,
        step,
        evaluate_fn,
        checkpointer,
        start_step,
        parallel,
    )


def train_sft(cfg: SFTConfig) -> Path:
    """Fine-tune `cfg.model` on `cfg.data`; returns the run directory (config.yaml, metrics.jsonl,
    data_report.json, checkpoints/, final/: an HF directory, the PEFT adapter with `lora`, or the quantized
    model with `qat`)."""
    session = start_sft(cfg)
    train_and_evaluate(
        cfg, session.step, session.checkpointer, session.start_step, session.max_steps, session.evaluate, desc="sft"
    )
    if session.parallel is not None and session.parallel.wrapped is not None:
        save_final_parallel(session.parallel, session.tokenizer, session.run_dir, base_model=cfg.model.name_or_path)
    else:
        save_final_dir(session.model, session.tokenizer, session.run_dir, base_model=cfg.model.name_or_path)
    return session.run_dir

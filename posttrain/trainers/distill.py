"""Knowledge distillation: a student trained toward a frozen teacher's next-token distributions.

The loss is a token-level divergence from `posttrain.algos.distill.DISTILL_LOSSES` (forward_kl,
reverse_kl, jsd with `beta`), at completion positions only, summed and divided by the completion
tokens of the whole optimizer step (as SFT normalises). Both models see the same token ids, so they
must share the tokenizer: the vocabularies are compared id by id before anything is trained.

Where the completions come from (`mode`):
- off_policy: the dataset's completions (prompt/completion, chat, or a pair's chosen), with the SFT
  completion masks. Supervised KD (forward KL on data) and SeqKD-style runs.
- on_policy: the student samples completions for the training rows' prompts with the rollout engine,
  which runs over the live student module; after each optimizer step `llm.weights_updated()`, so
  the next samples come from the updated student. GKD (Agarwal et al. 2024) with lambda = 1.

Held-out evaluation: the mean divergence on held-out dataset completions (eval_loss), before the
first step and after the last.

With `lora:` (and QLoRA, `quant:`) the student trains adapters only and `final/` is its PEFT adapter; the
engine samples on-policy completions from the student with its adapters on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from posttrain.algos.distill import DISTILL_LOSSES
from posttrain.checkpoint.resume import open_run
from posttrain.data.collate import Batch, collate
from posttrain.data.config import DataConfig
from posttrain.data.dataset import build_sft_rows, split_holdout
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedRow
from posttrain.data.validate import DataError
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import all_reduce_count, reduce_metrics
from posttrain.distributed.parallel import Parallel
from posttrain.distributed.processes import join_processes
from posttrain.engine import LLM, EngineConfig, SamplingParams
from posttrain.errors import PosttrainError
from posttrain.models.hub import load_model
from posttrain.models.transformer import Transformer
from posttrain.peft import LoraConfig
from posttrain.rollout.collect import prompt_seed_base
from posttrain.rollout.generate import EngineCall
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.adapters import check_adapter_options, load_trainable, save_final_parallel
from posttrain.trainers.faults import BadStepGuard
from posttrain.trainers.lifecycle import open_checkpointer, pad_token_id, train_and_evaluate, write_data_report
from posttrain.trainers.loop import batch_stream, seed_everything
from posttrain.trainers.optim import optimizer_for, optimizer_step
from posttrain.trainers.schedule import scheduler_for
from posttrain.trainers.sections import LogSection, ModelSection, OptimSection, TrainSection

logger = logging.getLogger("posttrain.trainers")


class VocabMismatchError(PosttrainError):
    """Teacher and student do not share a tokenizer / vocabulary."""


@dataclass
class TeacherSection:
    name_or_path: str = ""  # HF directory, .gguf file or known name; must share the student's tokenizer
    dtype: str | None = None  # default: the student's compute dtype

    def validate(self) -> None:
        if not self.name_or_path:
            raise ValueError("name_or_path: a teacher model is required (teacher.name_or_path=...)")


@dataclass
class DistillConfig:
    model: ModelSection = field(default_factory=ModelSection)  # the student
    teacher: TeacherSection = field(default_factory=TeacherSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5))
    train: TrainSection = field(default_factory=TrainSection)
    log: LogSection = field(default_factory=LogSection)  # trackers besides metrics.jsonl: docs/tracking.md
    loss: str = "forward_kl"  # one of DISTILL_LOSSES: forward_kl reverse_kl jsd
    beta: float = 0.5  # jsd only: weight of the teacher in the mixture (0: forward KL, 1: reverse KL)
    temperature: float = 1.0  # softmax temperature of both models in the divergence
    mode: Literal["off_policy", "on_policy"] = "off_policy"
    max_new_tokens: int = 64  # on_policy: tokens the student samples per prompt
    sample_temperature: float = 1.0  # on_policy: the student's sampling temperature
    # on_policy: seed each prompt's sample from (train.seed, step, its place among the step's prompts), so it does
    # not depend on the rank or the batch it lands in: N processes then sample what one process samples.
    seed_prompts: bool = False
    lora: LoraConfig | None = None  # train LoRA adapters on the student only; final/ is then the PEFT adapter
    quant: str | None = None  # QLoRA: quantize the student's frozen base under the adapters; needs lora
    out: str | None = None  # the run directory; default runs/distill-<timestamp>
    resume: str | None = None  # auto (the newest checkpoint in out) or a checkpoint directory; see docs/resume.md
    dist: DistSection = field(default_factory=DistSection)  # torchrun data parallelism; see docs/distributed.md

    def validate(self) -> None:
        check_adapter_options(self.lora, self.quant)
        if self.loss not in DISTILL_LOSSES:
            raise ValueError(f"loss: unknown loss {self.loss!r} (choose from {', '.join(DISTILL_LOSSES)})")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.sample_temperature < 0:
            raise ValueError(f"sample_temperature must be >= 0, got {self.sample_temperature}")

    def loss_kwargs(self) -> dict[str, float]:
        return {"temperature": self.temperature, **({"beta": self.beta} if self.loss == "jsd" else {})}


# ----------------------------------------------------------------------------- checks and pieces


def check_shared_vocab(
    student: Transformer, student_tok: Any, teacher: Transformer, teacher_tok: Any, student_name: str, teacher_name: str
) -> None:
    """Raise VocabMismatchError unless both models have the same logit width and tokenizers with the same id -> token map."""
    sv, tv = student.config.vocab_size, teacher.config.vocab_size
    if sv != tv:
        raise VocabMismatchError(
            f"teacher {teacher_name} has {tv} logits per token, student {student_name} has {sv}: "
            "distillation needs one shared vocabulary"
        )
    if student_tok.vocab_size != teacher_tok.vocab_size:
        raise VocabMismatchError(
            f"teacher tokenizer ({teacher_name}) has {teacher_tok.vocab_size} tokens, student's "
            f"({student_name}) {student_tok.vocab_size}: they must share a tokenizer"
        )
    ids = list(range(student_tok.vocab_size))
    for i, (a, b) in enumerate(zip(student_tok.convert_ids_to_tokens(ids), teacher_tok.convert_ids_to_tokens(ids))):
        if a != b:
            raise VocabMismatchError(
                f"teacher and student tokenizers differ at id {i}: student {a!r}, teacher {b!r} "
                f"({student_name} vs {teacher_name}); they must share a tokenizer"
            )


def divergence_sum(
    student: Transformer, teacher: Transformer, batch: Batch, loss: str, kwargs: dict[str, float]
) -> torch.Tensor:
    """Summed per-token divergence over the batch's completion targets (float32 scalar)."""
    keep = batch.targets != IGNORE_INDEX  # (B, T)
    student_logits = student.logits(student.hidden_states(batch.input_ids, **batch.model_kwargs())[keep])  # (N, V)
    with torch.no_grad():
        teacher_logits = teacher.logits(teacher.hidden_states(batch.input_ids, **batch.model_kwargs())[keep])  # (N, V)
    return DISTILL_LOSSES[loss](student_logits, teacher_logits, **kwargs).sum()


def prompt_of(row: TokenizedRow) -> list[int]:
    """The ids before a row's first label: its prompt as the chat template renders it (generation header included)."""
    start = next((i for i, label in enumerate(row.labels) if label != IGNORE_INDEX), len(row))
    return row.input_ids[:start]


def sampled_rows(
    llm: LLM,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    seeds: Sequence[int] | None = None,
    keep_empty: bool = False,
    lockstep: EngineCall = nullcontext,
) -> list[TokenizedRow]:
    """Prompt + student sample as rows labelled on the sampled tokens. `seeds`: prompt i's request is seeded with
    seeds[i]. An empty sample is dropped, or with `keep_empty` kept as a prompt-only row with no targets (under
    torchrun every rank must run the same forwards, even one whose samples all came back empty). `lockstep`: the
    engine call runs inside it (`Parallel.rollout`)."""
    per_prompt: SamplingParams | list[SamplingParams] = params
    if seeds is not None:
        per_prompt = [replace(params, seed=seed) for seed in seeds]
    with lockstep():
        outputs = llm.generate(list(prompts), per_prompt)
    rows = []
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0].token_ids
        if completion or keep_empty:
            rows.append(TokenizedRow(list(prompt) + list(completion), [IGNORE_INDEX] * len(prompt) + list(completion)))
    return rows


@torch.no_grad()
def evaluate_divergence(
    student: Transformer,
    teacher: Transformer,
    rows: list[TokenizedRow],
    cfg: DistillConfig,
    pad_id: int,
    parallel: Parallel | None = None,
) -> dict[str, float]:
    """Token-mean divergence over `rows`; under torchrun every rank evaluates all of them (the same forwards)."""
    was_training = student.training
    student.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), cfg.train.batch_size):
        batch = collate(rows[start : start + cfg.train.batch_size], pad_id).to(student.device)
        if parallel is not None:
            total += float(parallel.run(lambda m, b: divergence_sum(m, teacher, b, cfg.loss, cfg.loss_kwargs()), batch))
        else:
            total += float(divergence_sum(student, teacher, batch, cfg.loss, cfg.loss_kwargs()))
        count += batch.num_targets
    student.train(was_training)
    return {"eval_loss": total / max(count, 1), "eval_tokens": count}


# ----------------------------------------------------------------------------- the trainer


def train_distill(cfg: DistillConfig) -> Path:
    """Distill `cfg.teacher` into `cfg.model`; returns the run directory (final/ is the student)."""
    cfg.validate()
    cfg.teacher.validate()
    seed_everything(cfg.train.seed)
    ctx, model_section = join_processes(cfg.dist, cfg.model)
    student, tokenizer = load_trainable(model_section, lora=cfg.lora, quant=cfg.quant)
    teacher, teacher_tok = load_model(
        cfg.teacher.name_or_path, dtype=cfg.teacher.dtype or student.dtype, device=student.device
    )
    check_shared_vocab(student, tokenizer, teacher, teacher_tok, cfg.model.name_or_path, cfg.teacher.name_or_path)
    teacher.eval().requires_grad_(False)
    pad_id = pad_token_id(tokenizer, cfg.model.name_or_path)

    loaded = build_sft_rows(cfg.data, tokenizer)
    report: dict[str, Any] = {
        "path": cfg.data.path,
        "format": loaded.format,
        "rows_read": loaded.rows_read,
        "rows_kept": len(loaded.rows),
        "bad_rows": [vars(b) for b in loaded.bad_rows],
    }
    rows, eval_rows = split_holdout(loaded.rows, cfg.data.eval_fraction, cfg.train.seed)
    if cfg.data.eval_path:
        eval_rows = build_sft_rows(cfg.data, tokenizer, path=cfg.data.eval_path).rows
    prompts: list[list[int]] = []
    if cfg.mode == "on_policy":  # the training rows' prompts: held-out rows stay unseen
        prompts = [p for p in map(prompt_of, rows) if p and len(p) + cfg.max_new_tokens <= cfg.data.max_length]
        if not prompts:
            raise DataError(
                f"{cfg.data.path}: no training row has a prompt that leaves room for max_new_tokens="
                f"{cfg.max_new_tokens} within data.max_length={cfg.data.max_length} (on-policy "
                "distillation needs prompt/completion, chat or preference rows)"
            )
        report["prompts"] = len(prompts)

    train_cfg, optim_cfg = cfg.train, cfg.optim
    units = len(prompts) if cfg.mode == "on_policy" else len(rows)
    max_steps = train_cfg.total_steps(units)
    start = open_run("distill", cfg)
    run_dir = start.run_dir
    write_data_report(run_dir, report)
    logger.info(
        "distill (%s, %s): %d %s, %d held-out rows; %d steps of %d; run dir %s",
        cfg.loss,
        cfg.mode,
        units,
        "prompts" if cfg.mode == "on_policy" else "rows",
        len(eval_rows),
        max_steps,
        train_cfg.items_per_step,
        run_dir,
    )

    student.train()
    # The teacher stays a whole frozen copy on every rank; the student is what the strategy spreads.
    # Before the optimizer: FSDP2 replaces the Parameters by shards.
    parallel = Parallel(student, cfg.dist, ctx, compute_dtype=model_section.autocast_dtype(student))
    parallel.check_divides("train.batch_size", train_cfg.batch_size)
    optimizer = optimizer_for(student, optim_cfg)
    scheduler = scheduler_for(optimizer, optim_cfg, max_steps)
    kwargs = cfg.loss_kwargs()
    llm: LLM | None = None
    if cfg.mode == "on_policy":
        blocks = train_cfg.batch_size * (math.ceil(cfg.data.max_length / 16) + 1) + 8
        llm = LLM(
            model=student,
            tokenizer=tokenizer,
            config=EngineConfig(
                num_kv_blocks=blocks,
                max_model_len=cfg.data.max_length,
                max_num_seqs=train_cfg.batch_size,
                max_num_batched_tokens=max(2048, cfg.data.max_length),
            ),
        )
        params = SamplingParams(temperature=cfg.sample_temperature, max_tokens=cfg.max_new_tokens)
        stream = prompt_stream = batch_stream(prompts, train_cfg.batch_size, seed=train_cfg.seed)
    else:
        stream = row_stream = batch_stream(rows, train_cfg.batch_size, seed=train_cfg.seed)
    guard = BadStepGuard(train_cfg.max_bad_steps)

    sharded = parallel.wrapped is not None
    if sharded and cfg.mode == "on_policy":
        # Each rank's unseeded samples draw from their own stream (rank 0's is the single-process one).
        torch.manual_seed(train_cfg.seed + ctx.rank)

    def next_rows(step: int, micro: int) -> list[TokenizedRow]:
        if llm is None:
            return parallel.shard(next(row_stream))  # this rank's share of the global batch
        # (place among the step's prompts, prompt) for the global micro-batch; this rank samples its share.
        places = parallel.shard(list(enumerate(next(prompt_stream), start=micro * train_cfg.batch_size)))
        seeds = [prompt_seed_base(train_cfg.seed, step) + place for place, _ in places] if cfg.seed_prompts else None
        student.eval()
        with parallel.rollout() as lockstep:  # FSDP2: whole weights, or layer by layer (docs/distributed.md)
            sampled = sampled_rows(llm, [p for _, p in places], params, seeds, keep_empty=sharded, lockstep=lockstep)
        student.train()
        return sampled

    def step_fn(step: int) -> dict[str, float]:
        micro_rows = [next_rows(step, m) for m in range(train_cfg.grad_accum)]
        batches = [collate(r, pad_id).to(student.device) for r in micro_rows if r]
        targets = int(all_reduce_count(sum(b.num_targets for b in batches), student.device))  # over every rank
        if not batches or targets == 0:
            logger.warning("distill: step %d has no completion tokens (every sample was empty); skipped", step + 1)
            optimizer_step(optimizer, scheduler, optim_cfg.max_grad_norm)
            return {"loss": 0.0, "tokens": 0, "loss_tokens": 0, "empty_step": 1}

        def loss_sum(b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            divergence = parallel.run(lambda m, batch: divergence_sum(m, teacher, batch, cfg.loss, kwargs), b)
            return divergence, {"tokens": b.num_tokens}

        out = accumulate_gradients(batches, loss_sum, targets, parallel)
        out = reduce_metrics(out, {"loss", "tokens"}, student.device)  # the step's loss and tokens over every rank
        grad_norm, applied = optimizer_step(optimizer, scheduler, optim_cfg.max_grad_norm, loss=out["loss"])
        guard.record(step + 1, applied, out["loss"], grad_norm)
        if llm is not None:
            llm.weights_updated()  # the next samples come from the updated student
        return {**out, "grad_norm": grad_norm, "loss_tokens": targets, "skipped_updates": guard.total}

    # On-policy samples draw from torch's generator, which the checkpoint restores with the rest.
    state = {"data": stream, "faults": guard}
    checkpointer, start_step = open_checkpointer(
        "distill", cfg, start, student, tokenizer, optimizer, scheduler, parallel, state=state
    )
    wrapped = parallel if parallel.wrapped is not None else None
    eval_fn = (lambda: evaluate_divergence(student, teacher, eval_rows, cfg, pad_id, wrapped)) if eval_rows else None

    def held_out(when: str, record: dict[str, float]) -> None:
        logger.info("distill: held-out %s %s training %.4f", cfg.loss, when, record["eval_loss"])

    train_and_evaluate(
        cfg, step_fn, checkpointer, start_step, max_steps, eval_fn, desc=f"distill[{cfg.loss}]", report=held_out
    )
    student.eval()
    save_final_parallel(parallel, tokenizer, run_dir, base_model=cfg.model.name_or_path)
    return run_dir

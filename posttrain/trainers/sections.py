"""Config sections every trainer shares: which model, how to optimize, how long to train.

A trainer's config is a dataclass built from these plus its own sections (see `SFTConfig`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch

from posttrain.chat_templates import load_chat_template
from posttrain.hardware import auto_dtype
from posttrain.models.checkpoint_io import DTYPES
from posttrain.models.hub import DEFAULT_MODEL
from posttrain.models.transformer import Transformer
from posttrain.trackers import check_installed, resolve_report_to
from posttrain.trainers.loop import steps_for_epochs
from posttrain.trainers.schedule import SCHEDULES

logger = logging.getLogger("posttrain.trainers")


@dataclass
class ModelSection:
    name_or_path: str = DEFAULT_MODEL  # HF directory, .gguf file or known name
    # auto | float32 | bfloat16 | float16. auto (null too): bf16 on GPU; on CPU fp32 weights, and the training
    # forwards in bf16 under autocast where the CPU has fast bf16 (posttrain.hardware; `posttrain info` says which).
    dtype: str | None = "auto"
    device: str | None = None  # cpu | cuda | cuda:N; default cuda if available
    # CPU with glibc: `keep` leaves glibc's own policy, which holds freed blocks as heap holes (resident memory
    # 10-30% above the live tensors); `release` hands freed tensor memory back to the OS while training, so
    # resident memory follows the live tensors (what `posttrain estimate` counts) at a cost in page faults
    # (LoRA SFT steps 1.5x slower here; posttrain.cpu_malloc, docs/estimate.md).
    cpu_memory: Literal["keep", "release"] = "keep"
    # Replaces the checkpoint's chat template: a built-in name (`chatml_tools`: ChatML with tool calls, for
    # agentic RL with the default model; docs/agents.md) or a path to a .jinja file. The final checkpoint keeps it.
    chat_template: str | None = None

    def validate(self) -> None:
        if self.dtype is not None and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.chat_template is not None:
            load_chat_template(self.chat_template, key="model.chat_template")  # a bad name fails before any load

    def autocast_dtype(self, model: Transformer) -> torch.dtype | None:
        """The dtype the training forwards of `model` (as loaded from this section) autocast to: bf16 with `auto`
        on a CPU whose bf16 is fast, over the fp32 (master) weights; None otherwise: the weights' own dtype,
        today's path bit for bit."""
        if self.dtype not in (None, "auto") or model.device.type != "cpu" or model.dtype != torch.float32:
            return None
        choice = auto_dtype("cpu")
        if choice.dtype != "bfloat16":
            return None
        logger.info("posttrain: model.dtype=auto computes the training forwards in bf16 (%s)", choice.reason)
        return torch.bfloat16


@dataclass
class OptimSection:
    lr: float = 2e-5
    weight_decay: float = 0.0  # on matrices only; norm weights and biases are never decayed
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # of the total steps; used when warmup_steps is 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0  # the decay's floor, as a fraction of lr
    max_grad_norm: float | None = 1.0  # null: no clipping (the norm is still logged)

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or null, got {self.max_grad_norm}")
        assert self.schedule in SCHEDULES


@dataclass
class TrainSection:
    """`train:` of the offline trainers (sft, dpo-family, rm, distill). Its `epochs` are passes over the training
    data; RL's `train:` is rl.config.RLTrainSection, whose `epochs` are PPO epochs over each rollout batch."""

    batch_size: int = 8  # rows (or packed rows) per forward pass
    grad_accum: int = 1  # forward passes per optimizer step; rows per step = batch_size * grad_accum
    max_steps: int | None = None  # optimizer steps; null: derived from epochs
    epochs: float = 1.0  # passes over the training data (may be fractional); used when max_steps is null
    seed: int = 0
    log_every: int = 1  # steps between metrics.jsonl records
    save_every: int = 0  # steps between checkpoints/step-N saves; 0: only the final model
    keep_checkpoints: int | None = None  # keep the newest N step checkpoints; null: keep all
    eval_every: int = 0  # steps between evaluations (when there is eval data); 0: only at the end
    progress: bool = True  # tqdm progress bar on stderr
    # An update with a non-finite loss or gradient norm is skipped (weights untouched); this many in a
    # row end the run with an error naming the step.
    max_bad_steps: int = 5

    def validate(self) -> None:
        for name in ("batch_size", "grad_accum", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1 or null, got {self.max_steps}")
        if not self.epochs > 0:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        for name in ("save_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 or null, got {self.keep_checkpoints}")

    @property
    def items_per_step(self) -> int:
        """Rows (pairs, prompts) per optimizer step, over every rank."""
        return self.batch_size * self.grad_accum

    def total_steps(self, num_items: int) -> int:
        """The run's optimizer steps: `max_steps`, or what `epochs` passes over `num_items` items take."""
        return self.max_steps or steps_for_epochs(num_items, self.epochs, self.items_per_step)


@dataclass
class LogSection:
    """Where the metrics go besides `<run>/metrics.jsonl` (docs/tracking.md)."""

    # Experiment trackers, any of: tensorboard wandb trackio mlflow. One name alone is a list of one; none: no tracker.
    report_to: list[str] | str | None = field(default_factory=list)
    project: str = "posttrain"  # the W&B / Trackio project and the MLflow experiment
    tensorboard: bool = False  # the older switch: true adds tensorboard to report_to

    def trackers(self) -> list[str]:
        """The tracker names of `report_to` (with `tensorboard`), in order, each once."""
        return resolve_report_to(self.report_to, self.tensorboard)

    def validate(self) -> None:
        # A missing library fails here, on load, before any compute.
        check_installed(resolve_report_to(self.report_to))
        if self.tensorboard:
            check_installed(["tensorboard"], asked_by="log.tensorboard is true")
        if not self.project.strip():
            raise ValueError("project must not be empty")

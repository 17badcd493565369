"""The `dist:` config section every trainer carries: how the model is spread over the torchrun processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

STRATEGIES = ("none", "ddp", "fsdp2")
ROLLOUT_WEIGHTS = ("whole", "per_layer")


@dataclass
class DistSection:
    # none: one process, the model as is. ddp: every rank holds the whole model, gradients all-reduced.
    # fsdp2: parameters, gradients and optimizer state sharded over the ranks (torch fully_shard per decoder
    # layer, then the root). ddp and fsdp2 need the torchrun environment (`torchrun ...` or `--nproc N`).
    strategy: Literal["none", "ddp", "fsdp2"] = "none"
    # fsdp2 only. true: a layer's parameters are freed after its forward and gathered again for the backward
    # (ZeRO-3-like, least memory); false: kept gathered from forward to backward (ZeRO-2-like, one all-gather
    # fewer per layer per micro-batch, the full layer weights held meanwhile).
    reshard_after_forward: bool = True
    # Recompute each decoder layer's activations in the backward instead of keeping them (any strategy).
    activation_checkpointing: bool = False
    # bf16 compute with fp32 master weights and fp32 gradient reduction; CUDA only (on CPU runs stay fp32,
    # with a warning). Needs model.dtype=float32 (the master weights).
    mixed_precision: bool = False
    # fsdp2 only: the weights the rollout engine runs on (RL rollouts, on-policy distillation, held-out sampling).
    # whole: every parameter gathered once per rollout, a full copy per rank meanwhile, no collectives while
    # generating. per_layer: FSDP2 gathers one decoder layer at a time inside every engine forward (the least
    # memory; all-gathers every step, and the ranks generate in lockstep). See docs/distributed.md.
    rollout_weights: Literal["whole", "per_layer"] = "whole"
    # RL only: the last M of torchrun's processes are rollout processes, each generating on its own copy of the
    # weights, which the trainer (rank 0, the one other process) broadcasts after every step (the LoRA adapters
    # only, with LoRA). Launch with `--nproc M+1`. See docs/distributed.md "Rollout processes".
    rollout_ranks: int = 0
    # How long the trainer waits on a rollout process (a batch, a weight sync), and they on it, before stopping
    # with an error naming the rank; a process that died is noticed sooner (its connection closes).
    rollout_timeout_s: float = 600.0

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.strategy != "fsdp2" and not self.reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward=false applies to strategy fsdp2 only (strategy is {self.strategy})"
            )
        if self.rollout_weights not in ROLLOUT_WEIGHTS:
            raise ValueError(
                f"rollout_weights must be one of {', '.join(ROLLOUT_WEIGHTS)}, got {self.rollout_weights!r}"
            )
        if self.rollout_weights == "per_layer" and self.strategy != "fsdp2":
            raise ValueError(
                f"rollout_weights=per_layer gathers FSDP2's sharded layers and applies to strategy fsdp2 "
                f"only (strategy is {self.strategy}, whose ranks hold whole weights)"
            )
        if isinstance(self.rollout_ranks, bool) or not isinstance(self.rollout_ranks, int) or self.rollout_ranks < 0:
            raise ValueError(f"rollout_ranks must be an integer >= 0, got {self.rollout_ranks!r}")
        if self.rollout_ranks and self.strategy != "none":
            raise ValueError(
                f"rollout_ranks={self.rollout_ranks} trains on one process (rank 0): strategy must be none, "
                f"got {self.strategy}"
            )
        if not self.rollout_timeout_s > 0:
            raise ValueError(f"rollout_timeout_s must be > 0, got {self.rollout_timeout_s!r}")

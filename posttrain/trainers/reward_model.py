"""Reward model: a scalar head on the decoder trunk, trained with the Bradley-Terry loss on pairs.

The score of a sequence is head(final-norm hidden state of its last token), exactly what
`posttrain.rewards.model_reward.RewardModelScorer` computes, and sequences are tokenized with the
scorer's own `encode_for_scoring` (a sequence over `data.max_length` is skipped, or with
`data.overlong: truncate` keeps its last max_length tokens, as the scorer does). The run's `final/`
(and every checkpoint) is an HF directory plus `score.safetensors`, which `RewardModelScorer(dir)`
and the RL trainer's model reward load as is.

With `lora:` (and QLoRA) the trunk trains adapters only and the head trains in full beside them (a fresh
head must learn); `final/` is then the PEFT adapter plus `score.safetensors`. `posttrain lora-merge` with
the base gives the trunk as an HF directory; with `score.safetensors` copied next to it, that directory is
the reward model.

Chosen and rejected sequences of a micro-batch go through one forward. A pair whose two sequences start
with the same tokens (the prompt, as a rule) is packed into one row, those tokens once and then each
sequence's rest, attending to the shared start and to itself only (posttrain.trainers.packed_groups, as
the DPO and RL trainers do); a micro-batch with a pair that shares nothing goes as 2B right-padded rows.
Either way a sequence's score is its own last state's, at the positions it has alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from posttrain.algos.reward import bradley_terry_loss
from posttrain.checkpoint.resume import open_run
from posttrain.data.collate import collate
from posttrain.data.config import DataConfig
from posttrain.data.preference_pairs import PairRow, load_pairs
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import all_reduce_count, barrier, is_main, reduce_metrics
from posttrain.distributed.parallel import Parallel, run_module
from posttrain.distributed.processes import join_processes
from posttrain.models.attention_metadata import DenseAttentionMetadata
from posttrain.models.transformer import Transformer
from posttrain.peft import LoraConfig
from posttrain.rewards.model_reward import save_score_head, tokenize_pair_for_scoring
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.adapters import check_adapter_options, load_trainable, save_final_parallel
from posttrain.trainers.faults import BadStepGuard
from posttrain.trainers.lifecycle import open_checkpointer, pad_token_id, train_and_evaluate, write_data_report
from posttrain.trainers.loop import batch_stream, seed_everything
from posttrain.trainers.optim import optimizer_for, optimizer_step
from posttrain.trainers.packed_groups import PackedGroups, pack_groups
from posttrain.trainers.schedule import scheduler_for
from posttrain.trainers.sections import LogSection, ModelSection, OptimSection, TrainSection

logger = logging.getLogger("posttrain.trainers")


@dataclass
class RMConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5, warmup_ratio=0.05))
    train: TrainSection = field(default_factory=TrainSection)
    log: LogSection = field(default_factory=LogSection)  # trackers besides metrics.jsonl: docs/tracking.md
    center_rewards_coefficient: float = 0.0  # > 0: add c * mean((r_w + r_l)^2)
    lora: LoraConfig | None = None  # train LoRA adapters on the trunk (the score head always trains in full)
    quant: str | None = None  # QLoRA: quantize the frozen trunk (int8, int4-g64, ...) under the adapters; needs lora
    out: str | None = None  # the run directory; default runs/rm-<timestamp>
    resume: str | None = None  # auto (the newest checkpoint in out) or a checkpoint directory; see docs/resume.md
    dist: DistSection = field(default_factory=DistSection)  # torchrun data parallelism; docs/distributed.md

    def validate(self) -> None:
        check_adapter_options(self.lora, self.quant)
        if self.center_rewards_coefficient < 0:
            raise ValueError(f"center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}")
        if self.data.eval_fraction == 0 and not self.data.eval_path and self.train.eval_every:
            raise ValueError("train.eval_every is set but there is no eval data (data.eval_path or data.eval_fraction)")


class RewardModel(nn.Module):
    """The trunk and its scalar head, as one module for the optimizer (the trunk's LM head gets no gradient)."""

    def __init__(self, trunk: Transformer, head: nn.Linear) -> None:
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded ids (R, T) and real lengths (R,) -> scores (R,) in float32."""
        hidden = self.trunk.hidden_states(input_ids)  # (R, T, d); right padding needs no mask (causal)
        last = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), lengths - 1]  # (R, d)
        return nn.functional.linear(
            last.float(), self.head.weight.float(), None if self.head.bias is None else self.head.bias.float()
        ).squeeze(-1)

    def packed(self, pack: PackedGroups) -> torch.Tensor:
        """Scores (S,) in float32 of the S sequences of `pack_sequences`' rows, in its sample order."""
        hidden = self.trunk.hidden_states(
            pack.input_ids, positions=pack.positions, attn_meta=DenseAttentionMetadata(pack.mask)
        )  # (R, T, d)
        lengths = pack.completion_mask.sum(1).long()  # (S,) each sequence's rest + the placeholder
        last = pack.token_index == lengths[pack.sample_index] - 1  # (N,) the placeholder of each sequence
        index = torch.empty_like(lengths).index_put_((pack.sample_index[last],), pack.gather_index[last])  # (S,)
        states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)  # (S, d) each sequence's last state
        return nn.functional.linear(
            states.float(), self.head.weight.float(), None if self.head.bias is None else self.head.bias.float()
        ).squeeze(-1)


def shared_start(pair: PairRow) -> int:
    """Leading tokens the pair's two sequences share and can share in a packed row: each keeps at least its last
    token of its own (its score is read there). 0: the pair does not pack."""
    chosen, rejected = pair.chosen.input_ids, pair.rejected.input_ids
    limit = min(len(chosen), len(rejected)) - 1
    shared = 0
    while shared < limit and chosen[shared] == rejected[shared]:
        shared += 1
    return shared


def pack_sequences(pairs: list[PairRow], device: torch.device | str) -> PackedGroups | None:
    """One packed row per pair: the shared start, then each sequence's rest. pack_groups scores every completion
    token from the state before it, so a placeholder appended to each rest is "predicted" from the sequence's
    last real token: its state is the one the score reads. Samples: chosen_0, rejected_0, chosen_1, ... None
    when some pair shares no token."""
    starts = [shared_start(p) for p in pairs]
    if min(starts) == 0:
        return None
    prompts = [p.chosen.input_ids[:s] for p, s in zip(pairs, starts)]
    rests = [[row.input_ids[s:] + [0] for row in (p.chosen, p.rejected)] for p, s in zip(pairs, starts)]
    return pack_groups(prompts, rests, device)


def new_score_head(hidden_size: int, device: torch.device | str) -> nn.Linear:
    """nn.Linear(d, 1) in fp32 without bias, N(0, 1/(d+1)) init (as TRL's reward modelling does)."""
    head = nn.Linear(hidden_size, 1, bias=False, device=device, dtype=torch.float32)
    nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden_size + 1))
    return head


def pair_scores(
    rm: RewardModel, pairs: list[PairRow], pad_token_id: int, parallel: Parallel | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores (B,), rejected scores (B,)) from one forward over the 2B sequences (through `parallel`'s
    DDP / FSDP2 hooks when given: under FSDP2 trunk and head are whole only inside them)."""
    pack = pack_sequences(pairs, rm.trunk.device)
    if pack is not None:
        scores = run_module(parallel, rm.trunk, lambda _trunk, p: rm.packed(p), pack)  # (2B,) pair by pair
        return scores[0::2], scores[1::2]
    batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_token_id).to(rm.trunk.device)
    lengths = batch.attention_mask.sum(1)  # (2B,)
    scores = run_module(parallel, rm.trunk, lambda _trunk, ids, n: rm(ids, n), batch.input_ids, lengths)  # (2B,)
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def evaluate_rm(
    rm: RewardModel, pairs: list[PairRow], batch_size: int, pad_token_id: int, parallel: Parallel | None = None
) -> dict[str, float]:
    """Held-out loss, pairwise accuracy (ties count half) and mean margin (through `parallel` when wrapped)."""
    was_training = rm.training
    rm.eval()
    loss, wins, margin = 0.0, 0.0, 0.0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        chosen, rejected = pair_scores(rm, chunk, pad_token_id, parallel)
        loss += float(bradley_terry_loss(chosen, rejected)[0]) * len(chunk)
        wins += float((chosen > rejected).float().sum() + 0.5 * (chosen == rejected).float().sum())
        margin += float((chosen - rejected).sum())
    rm.train(was_training)
    n = max(len(pairs), 1)
    return {"eval_loss": loss / n, "eval_accuracy": wins / n, "eval_margin": margin / n, "eval_pairs": len(pairs)}


def train_reward_model(cfg: RMConfig) -> Path:
    """Train a reward model on `cfg.data` pairs; returns the run dir, whose `final/` is a reward-model directory."""
    cfg.validate()
    seed_everything(cfg.train.seed)
    ctx, model_section = join_processes(cfg.dist, cfg.model)
    trunk, tokenizer = load_trainable(model_section, lora=cfg.lora, quant=cfg.quant)
    pad_id = pad_token_id(tokenizer, cfg.model.name_or_path)
    data = load_pairs(cfg.data, tokenizer, cfg.train.seed, tokenize=tokenize_pair_for_scoring)
    # The head is made after the adapters: apply_lora freezes every parameter it finds, and the head must train.
    rm = RewardModel(trunk, new_score_head(trunk.config.hidden_size, trunk.device)).train()
    train_cfg, optim_cfg = cfg.train, cfg.optim
    max_steps = train_cfg.total_steps(len(data.train))
    # The head's gradients are reduced with the trunk's; the trunk's LM head (untied) never gets one.
    tied = trunk.lm_head.weight is trunk.embed_tokens.weight
    parallel = Parallel(
        trunk,
        cfg.dist,
        ctx,
        beside={"head": rm.head},
        unused_parameters=not tied,
        compute_dtype=model_section.autocast_dtype(trunk),
    )
    parallel.check_divides("train.batch_size", cfg.train.batch_size)
    start = open_run("rm", cfg)
    run_dir = start.run_dir
    write_data_report(run_dir, data.report)
    logger.info(
        "rm: %d train / %d held-out pairs of %s; %d steps of %d pairs; run dir %s",
        len(data.train),
        len(data.eval),
        data.report["format"],
        max_steps,
        train_cfg.items_per_step,
        run_dir,
    )

    optimizer = optimizer_for(rm, optim_cfg)
    scheduler = scheduler_for(optimizer, optim_cfg, max_steps)
    stream = batch_stream(data.train, train_cfg.batch_size, seed=train_cfg.seed)
    guard = BadStepGuard(train_cfg.max_bad_steps)

    through = parallel if parallel.wrapped is not None else None  # the DDP / FSDP2 hooks, when there are any

    def loss_sum(pairs: list[PairRow]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = pair_scores(rm, pairs, pad_id, through)
        loss, metrics = bradley_terry_loss(chosen, rejected, center_coefficient=cfg.center_rewards_coefficient)
        tokens = sum(len(p.chosen) + len(p.rejected) for p in pairs)
        return loss * len(pairs), {**{k: float(v) * len(pairs) for k, v in metrics.items()}, "tokens": tokens}

    def step_fn(step: int) -> dict[str, float]:
        micro = [parallel.shard(next(stream)) for _ in range(train_cfg.grad_accum)]  # this rank's pairs
        pairs = int(all_reduce_count(sum(len(m) for m in micro), trunk.device))  # over every rank
        out = accumulate_gradients(micro, loss_sum, pairs, parallel)
        out = reduce_metrics(out, set(out), trunk.device)  # every entry is a sum over this rank's pairs
        grad_norm, applied = optimizer_step(optimizer, scheduler, optim_cfg.max_grad_norm, loss=out["loss"])
        guard.record(step + 1, applied, out["loss"], grad_norm)
        means = {k: v / pairs for k, v in out.items() if k not in ("loss", "tokens")}
        return {
            "loss": out["loss"],
            **means,
            "tokens": out["tokens"],
            "pairs": pairs,
            "grad_norm": grad_norm,
            "skipped_updates": guard.total,
        }

    # A checkpoint is a reward-model directory too (score.safetensors beside the trunk); the head is also in
    # modules.safetensors, which the resume reads.
    checkpointer, start_step = open_checkpointer(
        "rm",
        cfg,
        start,
        trunk,
        tokenizer,
        optimizer,
        scheduler,
        parallel,
        state={"data": stream, "faults": guard},
        modules={"head": rm.head},
        write_extras=lambda d: save_score_head(rm.head, d),
    )
    eval_fn = (lambda: evaluate_rm(rm, data.eval, train_cfg.batch_size, pad_id, through)) if data.eval else None

    def held_out(when: str, record: dict[str, float]) -> None:  # every rank scores all held-out pairs
        logger.info("rm: held-out accuracy %s training %.3f (%d pairs)", when, record["eval_accuracy"], len(data.eval))

    train_and_evaluate(cfg, step_fn, checkpointer, start_step, max_steps, eval_fn, desc="rm", report=held_out)
    rm.eval()
    final = save_final_parallel(parallel, tokenizer, run_dir, base_model=cfg.model.name_or_path)
    head = parallel.whole(rm.head)  # fsdp2: gathered on rank 0; ddp: every rank holds the same head
    if is_main():
        save_score_head(head, final)
    barrier()
    return run_dir

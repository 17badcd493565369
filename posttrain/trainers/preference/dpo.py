"""The DPO family (sigmoid, cdpo, robust, hinge, ipo, simpo, orpo, kto) on preference pairs.

One step: every pair of the micro-batch is collated as 2B right-padded rows (chosen rows, then
rejected rows) and goes through ONE forward; sequence log-probabilities are the sums of the
completion tokens' log-probs (LM head applied only at completion positions). The loss is picked
from `posttrain.algos.preference.PREFERENCE_LOSSES` by `loss:` and gets the tensors it names.

Reference log-probs (not for simpo / orpo, which are reference-free):
- `reference: precompute` — one no-grad pass of the initial model over every train and held-out
  pair before the first step; training then needs one model in memory.
- `reference: live` — a frozen copy of the initial model computes them for each batch.
Both give the same numbers (the reference is the initial policy either way). With `lora:` (and QLoRA)
the reference is the policy module itself with its adapters disabled: the base, never a copy.

KTO on pairs: each pair is unpaired into a desirable (chosen) and an undesirable (rejected) example
(TRL's `unpair_preference_dataset`); the KL reference point uses mismatched rows, the prompt of pair
i with the chosen completion of pair i+1 of the same split (fixed, so it can be precomputed).
KTO on an unpaired file (prompt, completion, label rows) runs `kto.KTORun` instead: fixed
batches of desirable / undesirable rows in any mix, KL rows from within each batch, as TRL's KTOTrainer.

Loss normalisation: each loss is a mean over its pairs; a micro-batch contributes mean * pairs, and
the step divides by all pairs of the step, so grad_accum splits give the batch-mean gradient.

Held-out evaluation (before the first step and at the end, plus every `train.eval_every`):
`eval_reward_accuracy` is the share of held-out pairs whose implicit reward (beta log pi/pi_ref;
beta * mean logp for simpo / orpo) is higher for chosen, ties (|difference| <= 1e-4) counted as
half — so the untrained policy, whose DPO implicit rewards are all 0, scores 0.5, not 0.
`eval_logp_accuracy` compares the per-token mean logps of chosen and rejected (informative before
training too).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from posttrain.algos.preference import PREFERENCE_LOSSES, TIE_TOLERANCE
from posttrain.checkpoint.resume import open_run
from posttrain.data.collate import collate
from posttrain.data.config import DataConfig
from posttrain.data.preference_pairs import PairRow, load_pairs
from posttrain.data.validate import DataError
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import all_gather_rows, all_reduce_count, reduce_metrics
from posttrain.distributed.parallel import Parallel, run_module
from posttrain.distributed.processes import join_processes
from posttrain.models.transformer import Transformer
from posttrain.peft import LoraConfig
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.adapters import check_adapter_options, load_trainable, prepare_trainable, save_final_parallel
from posttrain.trainers.faults import BadStepGuard
from posttrain.trainers.lifecycle import open_checkpointer, pad_token_id, train_and_evaluate, write_data_report
from posttrain.trainers.loop import batch_stream, seed_everything
from posttrain.trainers.optim import optimizer_for, optimizer_step
from posttrain.trainers.preference.kto import KTORun
from posttrain.trainers.preference.logps import PairInputs, batches_by_length, by_length, collate_pairs, pair_logps
from posttrain.trainers.preference.reference import Reference
from posttrain.trainers.preference.unpaired import is_unpaired, load_unpaired
from posttrain.trainers.schedule import scheduler_for
from posttrain.trainers.sections import LogSection, ModelSection, OptimSection, TrainSection

logger = logging.getLogger("posttrain.trainers")

REFERENCE_FREE = ("simpo", "orpo")
HEADLINE = {"acc": "rewards/accuracies", "margin": "rewards/margins"}  # beside the loss on the progress bar
LOSS_OPTIONS = ("beta", "label_smoothing", "gamma", "desirable_weight", "undesirable_weight")


@dataclass
class DPOConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=5e-7, warmup_ratio=0.1))
    train: TrainSection = field(default_factory=TrainSection)
    log: LogSection = field(default_factory=LogSection)  # trackers besides metrics.jsonl: docs/tracking.md
    loss: str = "sigmoid"  # one of PREFERENCE_LOSSES: sigmoid cdpo robust hinge ipo simpo orpo kto
    reference: Literal["precompute", "live"] = "precompute"  # ignored by simpo / orpo
    # Loss options; null: the loss function's own default. Each is only accepted by the losses that take it.
    beta: float | None = None
    label_smoothing: float | None = None  # cdpo, robust, simpo
    gamma: float | None = None  # simpo's target margin
    desirable_weight: float | None = None  # kto
    undesirable_weight: float | None = None  # kto
    lora: LoraConfig | None = None  # train LoRA adapters only; the reference is the base (adapters off)
    quant: str | None = None  # QLoRA: quantize the frozen base (int8, int4-g64, ...) under the adapters; needs lora
    out: str | None = None  # the run directory; default runs/dpo-<timestamp>
    resume: str | None = None  # auto (the newest checkpoint in out) or a checkpoint directory; see docs/resume.md
    dist: DistSection = field(default_factory=DistSection)  # torchrun data parallelism; see docs/distributed.md

    def validate(self) -> None:
        check_adapter_options(self.lora, self.quant)
        if self.loss not in PREFERENCE_LOSSES:
            raise ValueError(f"loss: unknown loss {self.loss!r} (choose from {', '.join(PREFERENCE_LOSSES)})")
        accepted = inspect.signature(PREFERENCE_LOSSES[self.loss]).parameters
        for name in LOSS_OPTIONS:
            if getattr(self, name) is not None and name not in accepted:
                raise ValueError(f"{name}: not an option of loss {self.loss!r}")
        if self.beta is not None and not self.beta > 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if self.data.eval_fraction == 0 and not self.data.eval_path and self.train.eval_every:
            raise ValueError("train.eval_every is set but there is no eval data (data.eval_path or data.eval_fraction)")

    @property
    def uses_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    def loss_options(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in LOSS_OPTIONS if getattr(self, name) is not None}

    def effective_beta(self) -> float:
        return (
            self.beta
            if self.beta is not None
            else inspect.signature(PREFERENCE_LOSSES[self.loss]).parameters["beta"].default
        )


# ----------------------------------------------------------------------------- the loss


def preference_loss(
    cfg: DPOConfig,
    policy: torch.Tensor,
    lengths: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    policy_kl: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured loss on one micro-batch. policy, lengths: (2B,) chosen then rejected."""
    half = policy.shape[0] // 2
    available: dict[str, Any] = {
        "policy_chosen_logps": policy[:half],
        "policy_rejected_logps": policy[half:],
        "chosen_lengths": lengths[:half].to(policy.dtype),
        "rejected_lengths": lengths[half:].to(policy.dtype),
    }
    if ref is not None:
        available.update(ref_chosen_logps=ref[0], ref_rejected_logps=ref[1])
    if cfg.loss == "kto":
        assert ref is not None
        available = {
            "policy_logps": policy,
            "ref_logps": torch.cat([ref[0], ref[1]]),
            "desirable": torch.arange(2 * half, device=policy.device) < half,
            "policy_kl_logps": policy_kl,
            "ref_kl_logps": ref[2],
        }
    fn = PREFERENCE_LOSSES[cfg.loss]
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in available.items() if k in params}
    return fn(**kwargs, **cfg.loss_options())


def implicit_rewards(cfg: DPOConfig, policy: torch.Tensor, lengths: torch.Tensor, ref: tuple | None) -> torch.Tensor:
    """(2B,) implicit reward of every row: beta log pi/pi_ref, or beta * mean logp when reference-free."""
    beta = cfg.effective_beta()
    if ref is None:
        return beta * policy / lengths.clamp(min=1).to(policy.dtype)
    return beta * (policy - torch.cat([ref[0], ref[1]]))


# ----------------------------------------------------------------------------- the trainer


@dataclass
class _Sums:
    """Metric sums over the micro-batches of a step (or an evaluation), weighted by pairs."""

    values: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, torch.Tensor | float], weight: float) -> None:
        for key, value in metrics.items():
            self.values[key] = self.values.get(key, 0.0) + float(value) * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {k: v / self.weights[k] for k, v in self.values.items() if self.weights[k] > 0}


def _nll_parts(policy: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    half = policy.shape[0] // 2
    return {
        "nll_sum/chosen": -float(policy[:half].sum()),
        "nll_sum/rejected": -float(policy[half:].sum()),
        "tokens/chosen": float(lengths[:half].sum()),
        "tokens/rejected": float(lengths[half:].sum()),
    }


def _finish_nll(raw: dict[str, float]) -> dict[str, float]:
    out = {k: v for k, v in raw.items() if not k.startswith(("nll_sum/", "tokens/"))}
    for side in ("chosen", "rejected"):
        if f"tokens/{side}" in raw:
            out[f"nll/{side}"] = raw[f"nll_sum/{side}"] / max(raw[f"tokens/{side}"], 1.0)
    return out


class DPORun:
    """The pieces a DPO run holds; `step` and `evaluate` are what the loop calls."""

    def __init__(
        self,
        cfg: DPOConfig,
        model: Transformer,
        train: list[PairRow],
        held: list[PairRow],
        pad_id: int,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`compute_dtype`: the autocast dtype of the policy's forwards (the Parallel's), which a precomputed
        reference is taken under too."""
        self.cfg, self.model, self.train, self.held, self.pad_id = cfg, model, train, held, pad_id
        # Set by `distribute` once the reference logps are taken from the unwrapped initial weights.
        self.parallel: Parallel | None = None
        kto_len = cfg.data.max_length if cfg.loss == "kto" else None
        self.reference = (
            Reference(
                cfg.reference,
                model,
                {"train": train, "eval": held},
                cfg.train.batch_size,
                pad_id,
                kto_len,
                compute_dtype=compute_dtype,
            )
            if cfg.uses_reference
            else None
        )

    def distribute(self, parallel: Parallel) -> None:
        """Run the policy's passes through `parallel` (DDP / FSDP2 hooks) from now on; each rank then takes its
        share of every micro-batch's pairs."""
        self.parallel = parallel
        if self.reference is not None:
            self.reference.parallel = parallel

    def _policy_logps(self, batch: PairInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return run_module(self.parallel, self.model, pair_logps, batch)

    def _forward(
        self, split: str, idx: Sequence[int], grad: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, tuple | None]:
        """(loss, loss metrics, policy logps (2B,), completion lengths (2B,), reference logps or None)."""
        pairs = self.train if split == "train" else self.held
        batch = collate_pairs([pairs[i] for i in idx], self.pad_id, self.model.device)
        with torch.set_grad_enabled(grad):
            policy, lengths = self._policy_logps(batch)  # (2B,), (2B,)
        ref = self.reference.logps(split, idx, batch) if self.reference is not None else None
        policy_kl = None
        if self.cfg.loss == "kto":
            assert ref is not None and ref[2] is not None
            kl_rows_ = [self.reference.kl[split][i] for i in idx]  # type: ignore[union-attr]
            kl_batch = collate(kl_rows_, self.pad_id).to(self.model.device)
            with torch.no_grad():  # through the DDP / FSDP2 hooks: FSDP2 holds only shards outside them
                policy_kl = self._policy_logps(kl_batch)[0]  # (B,)
            if self.parallel is not None and split == "train":
                # z0 is a mean over the micro-batch's KL rows, and each rank holds B/W of them: gather all W
                # shares (W*B/W,) so every rank clamps the same z0 as one process over the B pairs.
                # (Evaluation runs every held-out pair on every rank: nothing to gather there.)
                policy_kl, ref_kl = all_gather_rows(policy_kl), all_gather_rows(ref[2])
                ref = (ref[0], ref[1], ref_kl)
        loss, metrics = preference_loss(self.cfg, policy, lengths, ref, policy_kl)
        return loss, metrics, policy, lengths, ref

    def step(self, micro_batches: list[list[int]]) -> dict[str, float]:
        sums = _Sums()
        nll: dict[str, float] = {}
        tokens = 0

        def loss_sum(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
            nonlocal tokens
            loss, metrics, policy, lengths, _ = self._forward("train", idx, grad=True)
            sums.add(metrics, len(idx))
            for k, v in _nll_parts(policy.detach(), lengths).items():
                nll[k] = nll.get(k, 0.0) + v
            tokens += sum(len(self.train[i].chosen) + len(self.train[i].rejected) for i in idx)
            return loss * len(idx), {}

        micro_batches = by_length(micro_batches, self.train)  # the same pairs, less padding
        if self.parallel is not None:  # this rank's share of every micro-batch; the same count on every rank
            micro_batches = [self.parallel.shard(m) for m in micro_batches]
        # Normalised by the pairs of the step over every rank, so 2 ranks x B/2 pairs give the 1 x B gradient.
        pairs = int(all_reduce_count(sum(len(m) for m in micro_batches), self.model.device))
        out = accumulate_gradients(micro_batches, loss_sum, pairs, self.parallel)
        # loss, token and NLL sums add up over the ranks; the pair-weighted means (rewards/*, ...) are over equal
        # shares, so their mean over the ranks is the step's.
        summed = {"loss", "tokens", *nll}
        raw = reduce_metrics({"loss": out["loss"], **sums.means(), **nll, "tokens": tokens}, summed, self.model.device)
        return {**_finish_nll(raw), "pairs": pairs}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        sums, nll = _Sums(), {}
        wins, logp_wins = 0.0, 0.0
        for idx in batches_by_length(self.held, self.cfg.train.batch_size):
            loss, metrics, policy, lengths, ref = self._forward("eval", idx, grad=False)
            sums.add({"loss": loss, **metrics}, len(idx))
            for k, v in _nll_parts(policy, lengths).items():
                nll[k] = nll.get(k, 0.0) + v
            rewards = implicit_rewards(self.cfg, policy, lengths, ref)
            half = len(idx)
            diff = rewards[:half] - rewards[half:]  # (B,)
            tie = diff.abs() <= TIE_TOLERANCE
            wins += float((~tie & (diff > 0)).sum()) + 0.5 * float(tie.sum())
            mean_logp = policy / lengths.clamp(min=1)
            logp_wins += float((mean_logp[:half] > mean_logp[half:]).float().sum())
        self.model.train(was_training)
        n = max(len(self.held), 1)
        means = _finish_nll(nll)
        out = {"eval_" + k.replace("/", "_"): v for k, v in {**sums.means(), **means}.items()}
        out.update(eval_reward_accuracy=wins / n, eval_logp_accuracy=logp_wins / n, eval_pairs=len(self.held))
        return out


def _held_out_summary(record: dict[str, float]) -> str:
    keys = ("eval_reward_accuracy", "eval_logp_accuracy", "eval_rewards_margins", "eval_kl")
    return ", ".join(f"{key[5:].replace('_', ' ')} {record[key]:.3f}" for key in keys if key in record)


def train_dpo(cfg: DPOConfig, *, model: Transformer | None = None, tokenizer: Any = None) -> Path:
    """Train `cfg.model` (or the given module and tokenizer) on `cfg.data` pairs with `cfg.loss`; returns the
    run directory (config.yaml, data_report.json, metrics.jsonl, checkpoints/, final/)."""
    cfg.validate()
    unpaired = is_unpaired(cfg.data, cfg.loss)  # KTO's prompt/completion/label rows; other losses stop here
    seed_everything(cfg.train.seed)
    ctx, model_section = join_processes(cfg.dist, cfg.model)
    if model is None:
        model, tokenizer = load_trainable(model_section, lora=cfg.lora, quant=cfg.quant)
    elif tokenizer is None:
        raise ValueError("train_dpo: a model passed as a module needs its tokenizer")
    else:
        prepare_trainable(model, lora=cfg.lora, quant=cfg.quant)
    pad_id = pad_token_id(tokenizer, cfg.model.name_or_path)
    if unpaired:
        data: Any = load_unpaired(cfg.data, tokenizer, cfg.train.seed, cfg.train.batch_size)
    else:
        data = load_pairs(cfg.data, tokenizer, cfg.train.seed)
    if cfg.loss == "kto" and len(data.train) < 2:
        raise DataError("kto needs at least two training pairs")
    train_cfg, optim_cfg = cfg.train, cfg.optim
    max_steps = train_cfg.total_steps(len(data.train))
    start = open_run("dpo", cfg)
    run_dir = start.run_dir
    write_data_report(run_dir, data.report)
    unit = "rows" if unpaired else "pairs"
    logger.info(
        "dpo (%s, reference %s): %d train / %d held-out %s of %s (%d bad, skipped); %d steps of %d %s; run dir %s",
        cfg.loss,
        cfg.reference if cfg.uses_reference else "none",
        len(data.train),
        len(data.eval),
        unit,
        data.report["format"],
        len(data.report["bad_rows"]),
        max_steps,
        train_cfg.items_per_step,
        unit,
        run_dir,
    )

    model.train()
    # The autocast of every forward (bf16 with model.dtype auto on a CPU with fast bf16), the precomputed
    # reference's included: its table is taken before the Parallel exists.
    compute_dtype = cfg.model.autocast_dtype(model)
    if unpaired:
        run: Any = KTORun(cfg, model, data, pad_id, compute_dtype=compute_dtype)
    else:
        run = DPORun(cfg, model, data.train, data.eval, pad_id, compute_dtype=compute_dtype)
    # After the reference took the initial weights (a precomputed table or a plain frozen copy on every rank),
    # before the optimizer: FSDP2 replaces the Parameters by their shards.
    parallel = Parallel(model, cfg.dist, ctx, compute_dtype=compute_dtype)
    parallel.check_divides("train.batch_size", train_cfg.batch_size)
    # Every pass through the Parallel, one process too: it is what applies the autocast.
    run.distribute(parallel)
    optimizer = optimizer_for(model, optim_cfg)
    scheduler = scheduler_for(optimizer, optim_cfg, max_steps)
    if unpaired:
        stream = run.batch_stream(train_cfg.seed)  # fixed KTO batches: their KL rows are scored in advance
    else:
        stream = batch_stream(range(len(data.train)), train_cfg.batch_size, seed=train_cfg.seed)
    guard = BadStepGuard(train_cfg.max_bad_steps)

    def step_fn(step: int) -> dict[str, float]:
        out = run.step([next(stream) for _ in range(train_cfg.grad_accum)])
        grad_norm, applied = optimizer_step(optimizer, scheduler, optim_cfg.max_grad_norm, loss=out["loss"])
        guard.record(step + 1, applied, out["loss"], grad_norm)
        return {**out, "grad_norm": grad_norm, "skipped_updates": guard.total}

    # Built after the reference took the initial weights: a restore then changes only the policy.
    state = {"data": stream, "faults": guard}
    checkpointer, start_step = open_checkpointer(
        "dpo", cfg, start, model, tokenizer, optimizer, scheduler, parallel, state=state
    )
    eval_fn = run.evaluate if data.eval else None

    def held_out(when: str, record: dict[str, float]) -> None:
        logger.info("dpo: held-out %s training: %s (%d %s)", when, _held_out_summary(record), len(data.eval), unit)

    train_and_evaluate(
        cfg,
        step_fn,
        checkpointer,
        start_step,
        max_steps,
        eval_fn,
        desc=f"dpo[{cfg.loss}]",
        postfix=HEADLINE,
        report=held_out,
    )
    model.eval()
    save_final_parallel(parallel, tokenizer, run_dir, base_model=cfg.model.name_or_path)
    return run_dir

"""KTO on unpaired rows (prompt, completion, label): the run `train_dpo` drives for `loss: kto` on such a file.

A micro-batch is one fixed batch of B rows (`unpaired.fixed_batches`), desirable and undesirable
in any mix: one forward of the policy over the B rows (with gradients), one no-grad forward over the
batch's B KL rows (prompt k + completion k-1), and the reference log-probs of both, precomputed
before the first step or computed live (with LoRA: the policy with its adapters off). The loss is
`kto_loss` on that batch: z0 = max(0, mean KL-row log pi/pi_ref), then per row
desirable_weight (1 - sigmoid(beta (r - z0))) or undesirable_weight (1 - sigmoid(beta (z0 - r))),
averaged over the batch: TRL's KTOTrainer with one device. With grad_accum each micro-batch is
weighted by its rows, so the step's gradient is that of the mean over all its rows.

Data-parallel (`distribute`): each rank takes every W-th row of each fixed batch, with those rows' KL rows
and reference logps (both kept by row index, so any share finds its own); the loss is normalised by the
rows of every rank, and z0 is taken over the KL logps gathered from all ranks: the batch's, as one process.

Metrics (TRL's names): loss, kl (z0, row-weighted over micro-batches), rewards/chosen and
rewards/rejected (mean beta log pi/pi_ref of the step's desirable / undesirable rows; left out when
the step has none), rewards/margins, logps/chosen, logps/rejected, and the counts desirable and
undesirable. Held-out: the same over the fixed held-out batches, prefixed eval_.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from posttrain.algos.preference import kto_loss
from posttrain.data.collate import collate
from posttrain.distributed.env import all_gather_rows, all_reduce_count, reduce_metrics
from posttrain.distributed.parallel import run_module
from posttrain.models.transformer import Transformer
from posttrain.trainers.accumulate import accumulate_gradients
from posttrain.trainers.loop import BatchStream, batch_stream
from posttrain.trainers.preference.logps import frozen_logps, sequence_logps
from posttrain.trainers.preference.reference import UnpairedReference
from posttrain.trainers.preference.unpaired import UnpairedData, check_weights
from posttrain.trainers.sections import TrainSection

if TYPE_CHECKING:
    from posttrain.distributed.parallel import Parallel

T = TypeVar("T")


class KTOOptions(Protocol):
    """What a KTO run reads of its config (`DPOConfig` has it all; `train_dpo` passes its own)."""

    @property
    def reference(self) -> str: ...  # "precompute" or "live"

    @property
    def train(self) -> TrainSection: ...

    def effective_beta(self) -> float: ...

    def loss_options(self) -> dict[str, float]: ...


class KTORun:
    """The pieces of a KTO run on unpaired rows; `step` and `evaluate` are what the loop calls."""

    def __init__(
        self,
        cfg: KTOOptions,
        model: Transformer,
        data: UnpairedData,
        pad_id: int,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`compute_dtype`: the autocast dtype of the policy's forwards, which a precomputed reference is taken
        under too."""
        self.cfg, self.model, self.pad_id = cfg, model, pad_id
        self.parallel: Parallel | None = None  # set by `distribute`, after the reference took the initial weights
        self.splits = {"train": data.train, **({"eval": data.eval} if data.eval else {})}
        self.reference = UnpairedReference(
            cfg.reference, model, self.splits, cfg.train.batch_size, pad_id, compute_dtype=compute_dtype
        )
        self.beta = cfg.effective_beta()
        options = cfg.loss_options()
        check_weights(data.train.rows, options.get("desirable_weight", 1.0), options.get("undesirable_weight", 1.0))

    def distribute(self, parallel: Parallel) -> None:
        """Run the policy's passes through `parallel` from now on; each rank takes its share of every batch."""
        # Fixed batches are not all train.batch_size rows (the remainder, a lone last row joined to the one
        # before): every one must deal out evenly, since the ranks' forwards go in lockstep.
        for size in sorted({len(b) for b in self.splits["train"].batches}):
            parallel.check_divides("rows of a fixed KTO batch (train.batch_size, or the last one's)", size)
        self.parallel = self.reference.parallel = parallel

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(policy, *args)`, through the DDP / FSDP2 hooks when distributed."""
        return run_module(self.parallel, self.model, fn, *args)

    def batch_stream(self, seed: int) -> BatchStream[int]:
        """Endless, resumable stream of training micro-batches, each [one fixed batch id]."""
        return batch_stream(range(len(self.splits["train"].batches)), 1, seed=seed)

    def _forward(self, split: str, idx: Sequence[int], grad: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """(kto loss, mean over the rows `idx`; metric sums over those rows)."""
        data = self.splits[split]
        batch = collate([data.rows[i].row for i in idx], self.pad_id).to(self.model.device)
        with torch.set_grad_enabled(grad):
            policy, _ = self._run(sequence_logps, batch)  # (B,)
        with torch.no_grad():  # around the call: `Parallel.run` then reshards FSDP2's root, as no backward will
            policy_kl = self._run(frozen_logps, [data.kl[i] for i in idx], len(idx), self.pad_id).to(policy.device)
        ref, ref_kl = self.reference.logps(split, idx, policy.device)  # (B,), (B,)
        if self.parallel is not None and split == "train":
            # z0 is a mean over the batch's KL rows and this rank holds 1/W of them: gather every rank's share.
            # (Evaluation runs every held-out row on every rank: nothing to gather there.)
            policy_kl, ref_kl = all_gather_rows(policy_kl), all_gather_rows(ref_kl)
        desirable = torch.tensor([data.rows[i].desirable for i in idx], device=policy.device)  # (B,) bool
        loss, metrics = kto_loss(
            policy, ref, desirable, policy_kl_logps=policy_kl, ref_kl_logps=ref_kl, **self.cfg.loss_options()
        )
        rewards = self.beta * (policy.detach() - ref)  # (B,)
        sums = {
            "kl": float(metrics["kl"]) * len(idx),
            "rows": float(len(idx)),
            "tokens": float(sum(len(data.rows[i].row) + len(data.kl[i]) for i in idx)),
        }
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            sums[f"count/{side}"] = float(rows.sum())
            sums[f"rewards/{side}"] = float(rewards[rows].sum())
            sums[f"logps/{side}"] = float(policy.detach()[rows].sum())
        return loss, sums

    def step(self, micro_batches: list[list[int]]) -> dict[str, float]:
        """One optimizer step's gradients; each micro-batch is a list of fixed batch ids (one, from the stream)."""
        rows = [[i for b in micro for i in self.splits["train"].batches[b]] for micro in micro_batches]
        if self.parallel is not None:
            rows = [self.parallel.shard(idx) for idx in rows]

        def loss_sum(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
            loss, sums = self._forward("train", idx, grad=True)
            return loss * len(idx), sums

        # Normalised by the rows of every rank, so W ranks x B/W rows give the gradient of 1 x B.
        out = accumulate_gradients(
            rows, loss_sum, all_reduce_count(sum(map(len, rows)), self.model.device), self.parallel
        )
        out = reduce_metrics(out, set(out), self.model.device)  # all sums (and the ranks' parts of the loss)
        return {"loss": out["loss"], **_means(out), "tokens": out["tokens"]}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        totals: dict[str, float] = {"loss": 0.0}
        for idx in self.splits["eval"].batches:
            loss, sums = self._forward("eval", idx, grad=False)
            totals["loss"] += float(loss) * len(idx)
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value
        self.model.train(was_training)
        out = {"loss": totals["loss"] / totals["rows"], **_means(totals)}
        return {"eval_" + k.replace("/", "_"): v for k, v in out.items()}


def _means(sums: dict[str, float]) -> dict[str, float]:
    """Per-class means (TRL: a class absent from the step is left out), the row-weighted kl and the counts."""
    out = {
        "kl": sums["kl"] / sums["rows"],
        "desirable": sums["count/chosen"],
        "undesirable": sums["count/rejected"],
        "rows": sums["rows"],
    }
    for side in ("chosen", "rejected"):
        if sums[f"count/{side}"] > 0:
            for key in ("rewards", "logps"):
                out[f"{key}/{side}"] = sums[f"{key}/{side}"] / sums[f"count/{side}"]
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out

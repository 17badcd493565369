"""Reference log-probs for the preference losses: the initial policy's sequence logps of every row a
loss compares, precomputed before the first step (`reference: precompute`) or computed per batch by a
frozen copy (`live`). With LoRA (and QLoRA) the reference is the policy module itself with its adapters
disabled: the base, never a copy.

- `Reference`: by pair index, for pairs (chosen, rejected, and KTO-on-pairs' mismatched KL rows);
- `UnpairedReference`: by row index, for KTO's unpaired rows and their KL rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from posttrain.data.preference_pairs import PairRow, mismatched_row
from posttrain.data.tokenize import TokenizedRow
from posttrain.data.validate import DataError
from posttrain.distributed.parallel import Parallel, compute_scope, run_module
from posttrain.models.transformer import Transformer
from posttrain.peft import disable_adapters
from posttrain.trainers.adapters import has_adapters
from posttrain.trainers.preference.logps import PairInputs, frozen_logps, frozen_pair_logps, pair_logps
from posttrain.trainers.preference.unpaired import KTOSplit


def kl_rows(pairs: Sequence[PairRow], max_length: int) -> list[TokenizedRow]:
    """KTO's mismatched rows: prompt of pair i + chosen completion of pair (i + 1) mod n."""
    if len(pairs) < 2:
        raise DataError("kto needs at least two pairs per split for its KL reference point")
    return [mismatched_row(pairs[i], pairs[(i + 1) % len(pairs)], max_length) for i in range(len(pairs))]


class Reference:
    """Reference logps of the pairs of a split, by pair index: a precomputed table or a live frozen model.

    `logps(split, idx, batch)` -> (ref chosen (B,), ref rejected (B,), ref KL rows (B,) or None), on the batch's device.
    """

    def __init__(
        self,
        mode: str,
        policy: Transformer,
        splits: dict[str, list[PairRow]],
        batch_size: int,
        pad_token_id: int,
        kto_max_length: int | None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`compute_dtype`: the autocast dtype of the run's forwards (the Parallel's `compute_dtype`), which the
        precomputed table is taken under too, so the reference's logps come from the policy's own arithmetic."""
        self.mode, self.pad_token_id, self.splits = mode, pad_token_id, splits
        self.kl = {name: kl_rows(p, kto_max_length) for name, p in splits.items() if p} if kto_max_length else {}
        self.model: Transformer | None = None
        self.table: dict[str, dict[str, torch.Tensor]] = {}
        self.parallel: Parallel | None = None  # set by DPORun.distribute: the policy's DDP / FSDP2 wrapper
        # With LoRA the base IS the initial policy: its passes run the policy module with the adapters off,
        # so a live reference costs no second copy of the weights (and QLoRA's stays quantized).
        self.base_of_policy = has_adapters(policy)
        if mode == "live":
            self.model = policy if self.base_of_policy else copy.deepcopy(policy).eval().requires_grad_(False)
        else:
            with self._reference_weights(policy), compute_scope(policy.device.type, compute_dtype):
                for name, pairs in splits.items():
                    if not pairs:
                        continue
                    chosen, rejected = frozen_pair_logps(policy, pairs, batch_size, pad_token_id)
                    entry = {"chosen": chosen, "rejected": rejected}
                    if name in self.kl:
                        entry["kl"] = frozen_logps(policy, self.kl[name], batch_size, pad_token_id)
                    self.table[name] = entry

    def _reference_weights(self, model: Transformer) -> AbstractContextManager:
        return disable_adapters(model) if self.base_of_policy else nullcontext()

    def _run(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """`fn(reference model, *args)`; through the policy's wrapper when the reference is the policy itself
        (LoRA's base)."""
        return run_module(self.parallel, self.model, fn, *args)

    def logps(
        self, split: str, idx: Sequence[int], batch: PairInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        device = batch.input_ids.device
        if self.model is None:
            t = self.table[split]
            index = torch.tensor(list(idx))
            kl = t["kl"][index].to(device) if "kl" in t else None
            return t["chosen"][index].to(device), t["rejected"][index].to(device), kl
        with torch.no_grad(), self._reference_weights(self.model):
            both = self._run(lambda m, b: pair_logps(m, b)[0], batch)  # (2B,)
            kl = None
            if split in self.kl:
                rows = [self.kl[split][i] for i in idx]
                kl = self._run(lambda m: frozen_logps(m, rows, len(idx), self.pad_token_id)).to(device)
        half = len(idx)
        return both[:half], both[half:], kl


class UnpairedReference:
    """Reference logps of every row and every KL row of each split, by row index: a precomputed table,
    or a frozen model (a copy, or with LoRA the policy with its adapters off) asked per batch."""

    def __init__(
        self,
        mode: str,
        policy: Transformer,
        splits: dict[str, KTOSplit],
        batch_size: int,
        pad_id: int,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`compute_dtype`: as Reference's."""
        self.splits, self.pad_id = splits, pad_id
        self.base_of_policy = has_adapters(policy)
        self.model: Transformer | None = None
        self.table: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # split -> (rows (n,), KL rows (n,))
        self.parallel: Parallel | None = None  # set by KTORun.distribute
        if mode == "live":
            self.model = policy if self.base_of_policy else copy.deepcopy(policy).eval().requires_grad_(False)
            return
        with self._weights(policy), compute_scope(policy.device.type, compute_dtype):
            for name, split in splits.items():
                self.table[name] = (
                    frozen_logps(policy, [r.row for r in split.rows], batch_size, pad_id),
                    frozen_logps(policy, split.kl, batch_size, pad_id),
                )

    def _weights(self, model: Transformer) -> AbstractContextManager:
        return disable_adapters(model) if self.base_of_policy else nullcontext()

    def logps(self, split: str, idx: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(reference logps of the rows (B,), of their KL rows (B,)), on `device`."""
        if self.model is None:
            rows, kl = self.table[split]
            index = torch.tensor(list(idx))
            return rows[index].to(device), kl[index].to(device)
        data = self.splits[split]
        with self._weights(self.model):
            rows = self._frozen([data.rows[i].row for i in idx])
            kl = self._frozen([data.kl[i] for i in idx])
        return rows.to(device), kl.to(device)

    def _frozen(self, rows: list[TokenizedRow]) -> torch.Tensor:
        # LoRA's base is the policy module: through its wrapper. no_grad around the call: `Parallel.run` then
        # reshards FSDP2's root, as no backward will.
        with torch.no_grad():
            return run_module(self.parallel, self.model, frozen_logps, rows, len(rows), self.pad_id)

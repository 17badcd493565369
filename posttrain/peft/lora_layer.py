"""LoRALinear: a frozen base linear layer plus named low-rank adapters, one of them active.

    y = base(x) + B(A(dropout(x))) * scaling,   A (r, in), B (out, r), scaling = alpha / r  (rsLoRA: alpha / sqrt(r))

The base module is kept as it is (`base_layer`, the same parameter objects the model had), so an optimizer,
the rollout engine and a KL reference all see one storage. Merging adds the active adapter's delta into the
base weight in place and unmerging subtracts it again: no copy of the full weights is ever made, so an
unmerge restores the weight up to float rounding only.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from posttrain.errors import PosttrainError

LORA_INITS = ("kaiming", "gaussian")


class LoRALinear(nn.Module):
    """Wraps a linear layer (anything with `weight` (out, in), `in_features`, `out_features`).

    Accepts inputs of any leading shape, e.g. (B, T, in) on the dense path and (N, in) on the paged path.
    State: `active_adapter` (None = base only), `merged_adapter` (the adapter whose delta sits in the base
    weight, or None) and `disabled` (set by `disable_adapters`: base only, nothing merged).
    """

    def __init__(self, base_layer: nn.Module, module_name: str = "") -> None:
        super().__init__()
        self.base_layer = base_layer
        self.module_name = module_name  # for error messages, e.g. "layers.0.self_attn.q_proj"
        self.in_features: int = base_layer.in_features
        self.out_features: int = base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.r: dict[str, int] = {}
        self.alpha: dict[str, float] = {}
        self.use_rslora: dict[str, bool] = {}
        self.scaling: dict[str, float] = {}
        self.active_adapter: str | None = None
        self.merged_adapter: str | None = None
        self.disabled = False
        self.train(base_layer.training)  # new modules start in training mode; follow the model's mode

    # ---- adapters ---------------------------------------------------------------------------------

    def add_adapter(
        self,
        name: str,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        init: str = "kaiming",
        trainable: bool = True,
    ) -> None:
        """Create adapter `name` (B = 0, so the layer's output is unchanged until B is trained or loaded);
        it becomes the active adapter if none is active."""
        if not name or "." in name:
            raise PosttrainError(f"adapter name {name!r} must be non-empty and contain no '.'")
        if name in self.lora_A:
            raise PosttrainError(f"{self.module_name}: adapter {name!r} already exists")
        if init not in LORA_INITS:
            raise PosttrainError(f"unknown LoRA init {init!r} (choose from {', '.join(LORA_INITS)})")
        weight = self.base_layer.weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        factory = {"device": weight.device, "dtype": dtype}
        A = nn.Linear(self.in_features, r, bias=False, **factory)
        B = nn.Linear(r, self.out_features, bias=False, **factory)
        with torch.no_grad():
            if init == "kaiming":  # what nn.Linear and peft's default use: uniform(+-1/sqrt(in_features))
                nn.init.kaiming_uniform_(A.weight, a=math.sqrt(5))
            else:
                nn.init.normal_(A.weight, std=1.0 / r)
            nn.init.zeros_(B.weight)
        A.weight.requires_grad_(trainable)
        B.weight.requires_grad_(trainable)
        self.lora_A[name], self.lora_B[name] = A, B
        self.lora_dropout[name] = (nn.Dropout(dropout) if dropout > 0 else nn.Identity()).train(self.training)
        self.r[name], self.alpha[name], self.use_rslora[name] = r, float(alpha), use_rslora
        self.scaling[name] = alpha / math.sqrt(r) if use_rslora else alpha / r
        if self.active_adapter is None and self.merged_adapter is None:
            self.active_adapter = name

    def delete_adapter(self, name: str) -> None:
        self._require(name)
        if self.merged_adapter == name:
            raise PosttrainError(f"{self.module_name}: adapter {name!r} is merged; unmerge it before deleting it")
        for table in (self.lora_A, self.lora_B, self.lora_dropout):
            del table[name]
        for table in (self.r, self.alpha, self.use_rslora, self.scaling):
            del table[name]
        if self.active_adapter == name:
            self.active_adapter = None

    def set_active(self, name: str | None) -> None:
        if name is not None:
            self._require(name)
        if self.merged_adapter is not None and name != self.merged_adapter:
            raise PosttrainError(
                f"{self.module_name}: adapter {self.merged_adapter!r} is merged into the base weight; "
                "unmerge it before switching adapters"
            )
        self.active_adapter = name

    def adapter_names(self) -> list[str]:
        return list(self.lora_A.keys())

    def _require(self, name: str) -> None:
        if name not in self.lora_A:
            have = ", ".join(repr(n) for n in self.lora_A) or "none"
            raise PosttrainError(f"{self.module_name}: no adapter {name!r} (adapters: {have})")

    # ---- forward ----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        out = self.base_layer(x)  # (..., out)
        name = self.active_adapter
        if name is None or self.disabled or self.merged_adapter is not None:
            return out
        A, B = self.lora_A[name], self.lora_B[name]
        h = A(self.lora_dropout[name](x.to(A.weight.dtype))) * self.scaling[name]  # (..., r): scale the small tensor
        return out + B(h).to(out.dtype)

    # ---- merging ----------------------------------------------------------------------------------

    def delta_weight(self, name: str) -> torch.Tensor:
        """scaling * B @ A in fp32, (out, in)."""
        self._require(name)
        A, B = self.lora_A[name].weight, self.lora_B[name].weight
        return (B.detach().float() @ A.detach().float()) * self.scaling[name]

    def merge(self) -> None:
        """Add the active adapter into the base weight, in place."""
        if self.merged_adapter is not None:
            raise PosttrainError(f"{self.module_name}: adapter {self.merged_adapter!r} is already merged")
        if self.active_adapter is None:
            return
        self._add_to_weight(self.delta_weight(self.active_adapter), sign=1.0)
        self.merged_adapter = self.active_adapter

    def unmerge(self) -> None:
        """Subtract the merged adapter from the base weight again (exact up to float rounding)."""
        if self.merged_adapter is None:
            raise PosttrainError(f"{self.module_name}: no adapter is merged")
        self._add_to_weight(self.delta_weight(self.merged_adapter), sign=-1.0)
        self.merged_adapter = None

    def _add_to_weight(self, delta: torch.Tensor, sign: float) -> None:
        weight = self.base_layer.weight
        if not weight.dtype.is_floating_point:
            raise PosttrainError(f"{self.module_name}: cannot merge into a {weight.dtype} (quantized) base weight")
        with torch.no_grad():
            if weight.dtype == torch.float32:
                weight.add_(delta.to(weight.device), alpha=sign)
            else:  # add in fp32, round once
                weight.copy_(weight.float().add_(delta.to(weight.device), alpha=sign).to(weight.dtype))

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n}(r={self.r[n]}, scaling={self.scaling[n]:g})" for n in self.lora_A)
        return f"adapters=[{adapters}], active={self.active_adapter!r}, merged={self.merged_adapter!r}"

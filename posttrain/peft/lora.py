"""LoRA on the one model: config, apply, merge / unmerge in place, adapter selection, state dicts.

    model = apply_lora(model, LoraConfig(r=16, alpha=32, target_modules="all-linear"))
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)   # after apply_lora
    with disable_adapters(model): ref_logits = model(ids)                 # the base, for a KL reference

Targets are matched the way peft matches them, against HF module names (`model.layers.0.self_attn.q_proj`,
`lm_head`): a list entry matches a module whose name equals it or ends with `.<entry>`; a string other than
`all-linear` is a regular expression that must match the whole name. So a peft config's `target_modules`
means the same modules here. PEFT-format files are in `peft_format.py`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from posttrain.errors import CheckpointError, ConfigError, PosttrainError
from posttrain.models.checkpoint_io import ours_to_hf
from posttrain.peft.lora_layer import LORA_INITS, LoRALinear

ALL_LINEAR = "all-linear"
OUTPUT_LAYER = "lm_head"  # never part of `all-linear` (peft leaves the output embedding out too)
DEFAULT_ADAPTER = "default"


@dataclass
class LoraConfig:
    """One adapter's hyperparameters (the `lora:` section of a trainer config)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # Module names (q_proj, ..., or full names), `all-linear` (every decoder Linear, not lm_head), or a regex.
    target_modules: list[str] | str = ALL_LINEAR
    # Same forms as target_modules (except all-linear); matching modules are left out.
    exclude_modules: list[str] | str = field(default_factory=list)
    use_rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r
    init: Literal["kaiming", "gaussian"] = "kaiming"  # A's init; B always starts at zero

    @property
    def scaling(self) -> float:
        return self.alpha / self.r**0.5 if self.use_rslora else self.alpha / self.r

    def validate(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"r must be a positive integer, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"alpha must be a positive number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        _check_module_spec("target_modules", self.target_modules, allow_all_linear=True)
        _check_module_spec("exclude_modules", self.exclude_modules, allow_all_linear=False, allow_empty=True)
        if self.init not in LORA_INITS:
            raise ValueError(f"init must be one of {', '.join(LORA_INITS)}, got {self.init!r}")


def _check_module_spec(key: str, spec: object, allow_all_linear: bool, allow_empty: bool = False) -> None:
    if isinstance(spec, str):
        if spec == ALL_LINEAR and allow_all_linear:
            return
        if not spec:
            raise ValueError(f"{key} must not be empty")
        try:
            re.compile(spec)
        except re.error as exc:
            raise ValueError(f"{key}: {spec!r} is not a valid regular expression ({exc})") from None
        return
    if not isinstance(spec, (list, tuple)) or not all(isinstance(s, str) and s for s in spec):
        raise ValueError(f"{key} must be a list of module names or a string, got {spec!r}")
    if not spec and not allow_empty:
        raise ValueError(f"{key} must name at least one module (or be '{ALL_LINEAR}')")


# ---- module discovery and target matching ---------------------------------------------------------


def hf_module_name(name: str) -> str:
    """Our module name -> the HF one (`layers.0.mlp.up_proj` -> `model.layers.0.mlp.up_proj`, `lm_head`)."""
    return ours_to_hf(f"{name}.weight").removesuffix(".weight")


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Our module name -> LoRALinear, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_adapters(model: nn.Module) -> bool:
    """True when the model trains LoRA adapters: its reference model is then its own base, adapters off."""
    return bool(lora_layers(model))


def model_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module except the insides of LoRALinear layers (their base_layer and adapters)."""
    out: dict[str, nn.Module] = {}
    inside: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix) for prefix in inside):
            continue
        out[name] = module
        if isinstance(module, LoRALinear):
            inside.append(name + ".")
    return out


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, LoRALinear))


def _linear_names(modules: dict[str, nn.Module]) -> str:
    leaves = dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in modules.items() if _is_linear(m))
    return ", ".join(leaves)


def matches_spec(spec: list[str] | tuple[str, ...] | str, hf_name: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, hf_name) is not None
    return any(hf_name == s or hf_name.endswith("." + s) for s in spec)


def find_targets(
    model: nn.Module,
    target_modules: list[str] | str,
    exclude_modules: list[str] | str | None = None,
    source: str = "LoraConfig",
    error: type[PosttrainError] = PosttrainError,
) -> list[str]:
    """Our names of the Linear modules that `target_modules` selects (peft's matching rules, HF names).

    Raises for a target that matches nothing (naming it and listing the linear module names) and for a
    match that is not a Linear layer.
    """
    modules = model_modules(model)
    hf_names = {name: hf_module_name(name) for name in modules}
    if target_modules == ALL_LINEAR:
        selected = [n for n, m in modules.items() if _is_linear(m) and n != OUTPUT_LAYER]
        if not selected:
            raise error(f"{source}: target_modules='{ALL_LINEAR}' matches no Linear module")
    else:
        entries = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        for entry in entries:
            spec = entry if isinstance(target_modules, str) else [entry]
            if not any(matches_spec(spec, hf) for hf in hf_names.values()):
                how = " as a regex over HF module names like 'model.layers.0.self_attn.q_proj'" if spec is entry else ""
                raise error(
                    f"{source}: target_modules entry {entry!r} matches no module of the model{how} "
                    f"(linear modules: {_linear_names(modules)})"
                )
        selected = [n for n in modules if matches_spec(target_modules, hf_names[n])]
        for name in selected:
            if not _is_linear(modules[name]):
                raise error(
                    f"{source}: target {name!r} is a {type(modules[name]).__name__}; LoRA applies to Linear layers "
                    f"only (linear modules: {_linear_names(modules)})"
                )
    if exclude_modules:
        selected = [n for n in selected if not matches_spec(exclude_modules, hf_names[n])]
        if not selected:
            raise error(f"{source}: exclude_modules={exclude_modules!r} leaves no target module")
    _refuse_tied(model, selected, source, error)
    return selected


def _refuse_tied(model: nn.Module, names: list[str], source: str, error: type[PosttrainError]) -> None:
    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    for name in names:
        module = model.get_submodule(name)
        weight = module.base_layer.weight if isinstance(module, LoRALinear) else module.weight
        shared = [p for p in owners.get(id(weight), []) if not p.startswith(name + ".")]
        if shared:
            raise error(
                f"{source}: {name} shares its weight with {shared[0]} (tied embeddings); LoRA on a tied weight "
                "is not supported, leave it out of target_modules"
            )


# ---- apply / select / delete ----------------------------------------------------------------------


def apply_lora(model: nn.Module, cfg: LoraConfig, adapter_name: str = DEFAULT_ADAPTER) -> nn.Module:
    """Add adapter `adapter_name` to the targeted Linear layers, in place, and make it the active one.

    Every other parameter of the model is frozen; the new adapter is trainable. Call this before building
    the optimizer. B starts at zero, so the model's outputs are unchanged until training moves B.
    """
    try:
        cfg.validate()
    except ValueError as exc:
        raise ConfigError(f"LoraConfig: {exc}") from None
    check_new_adapter_name(model, adapter_name)
    targets = find_targets(model, cfg.target_modules, cfg.exclude_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        layer = wrap_linear(model, name)
        layer.add_adapter(adapter_name, cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora, cfg.init, trainable=True)
    set_adapter(model, adapter_name)
    return model


def check_new_adapter_name(model: nn.Module, adapter_name: str) -> None:
    """Refuse a name that cannot be added now: malformed, taken, or any adapter merged."""
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise PosttrainError(f"adapter name {adapter_name!r} must be a non-empty string without '.'")
    if adapter_name in adapter_names(model):
        raise PosttrainError(f"adapter {adapter_name!r} already exists (adapters: {', '.join(adapter_names(model))})")
    _refuse_if_merged(model, f"add adapter {adapter_name!r}")


def wrap_linear(model: nn.Module, name: str) -> LoRALinear:
    """The LoRALinear at `name`, replacing the plain Linear there (in its parent) on first use."""
    module = model.get_submodule(name)
    if isinstance(module, LoRALinear):
        return module
    layer = LoRALinear(module, name)
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer)
    return layer


def adapter_names(model: nn.Module) -> list[str]:
    names: dict[str, None] = {}
    for layer in lora_layers(model).values():
        names.update(dict.fromkeys(layer.adapter_names()))
    return list(names)


def active_adapter(model: nn.Module) -> str | None:
    actives = {layer.active_adapter for layer in lora_layers(model).values()} - {None}
    return next(iter(actives)) if actives else None


def set_adapter(model: nn.Module, adapter_name: str | None) -> None:
    """Make `adapter_name` the active adapter of every layer that has it (others run the base only);
    None runs the base model everywhere. Refused while an adapter is merged."""
    names = adapter_names(model)
    if adapter_name is not None and adapter_name not in names:
        raise PosttrainError(f"no adapter {adapter_name!r} (adapters: {', '.join(names) or 'none'})")
    merged = merged_adapter(model)
    if merged is not None and merged != adapter_name:
        raise PosttrainError(f"adapter {merged!r} is merged into the base weights; call unmerge_lora(model) first")
    for layer in lora_layers(model).values():
        layer.set_active(adapter_name if adapter_name in layer.lora_A else None)


def delete_adapter(model: nn.Module, adapter_name: str) -> None:
    """Remove an adapter everywhere; a layer left without adapters becomes its plain Linear again."""
    if adapter_name not in adapter_names(model):
        raise PosttrainError(f"no adapter {adapter_name!r} (adapters: {', '.join(adapter_names(model)) or 'none'})")
    if merged_adapter(model) == adapter_name:
        raise PosttrainError(
            f"adapter {adapter_name!r} is merged into the base weights; call unmerge_lora(model) first"
        )
    for name, layer in lora_layers(model).items():
        if adapter_name in layer.lora_A:
            layer.delete_adapter(adapter_name)
        if not layer.lora_A:
            _unwrap(model, name, layer)


def _unwrap(model: nn.Module, name: str, layer: LoRALinear) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, layer.base_layer)


# ---- merge / unmerge / disable --------------------------------------------------------------------


def merged_adapter(model: nn.Module) -> str | None:
    """The adapter whose delta is in the base weights now, or None."""
    merged = {layer.merged_adapter for layer in lora_layers(model).values()} - {None}
    return next(iter(merged)) if merged else None


def _refuse_if_merged(model: nn.Module, action: str) -> None:
    merged = merged_adapter(model)
    if merged is not None:
        raise PosttrainError(f"cannot {action}: adapter {merged!r} is merged; call unmerge_lora(model) first")


def merge_lora(model: nn.Module) -> None:
    """Add the active adapter into the base weights in place (W += scaling * B @ A). Forward then runs the
    plain base layers. A second merge is refused; `unmerge_lora` undoes it (up to float rounding).
    Merged adapters get no gradients: merge for inference, unmerge before training again."""
    layers = lora_layers(model)
    if not layers:
        raise PosttrainError("the model has no LoRA layers (call apply_lora or load_peft_adapter first)")
    merged = merged_adapter(model)
    if merged is not None:
        raise PosttrainError(f"adapter {merged!r} is already merged; call unmerge_lora(model) before merging again")
    if active_adapter(model) is None:
        raise PosttrainError(f"no active adapter to merge (adapters: {', '.join(adapter_names(model)) or 'none'})")
    for layer in layers.values():
        layer.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Subtract the merged adapter from the base weights again, in place."""
    layers = [layer for layer in lora_layers(model).values() if layer.merged_adapter is not None]
    if not layers:
        raise PosttrainError("no adapter is merged")
    for layer in layers:
        layer.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge the active adapter (unless already merged) and put the plain Linear layers back: the result is an
    ordinary model (e.g. for `save_hf_dir`). Other adapters are dropped. In place; returns the model."""
    layers = lora_layers(model)
    if layers and merged_adapter(model) is None and active_adapter(model) is not None:
        merge_lora(model)
    for name, layer in layers.items():
        _unwrap(model, name, layer)
    return model


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model inside the block (e.g. the KL reference). A merged adapter is unmerged on entry and
    merged again on exit, in place (up to float rounding); the active adapter is restored on exit."""
    layers = lora_layers(model)
    saved = {name: (layer.active_adapter, layer.merged_adapter, layer.disabled) for name, layer in layers.items()}
    if merged_adapter(model) is not None:
        unmerge_lora(model)
    for layer in layers.values():
        layer.disabled = True
    try:
        yield model
    finally:
        for name, layer in layers.items():
            active, merged, disabled = saved[name]
            layer.disabled = disabled
            if layer.merged_adapter is None:
                layer.active_adapter = active
                if merged is not None:
                    layer.merge()


# ---- parameters and state -------------------------------------------------------------------------


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require gradients (after apply_lora: the trainable adapters), each once."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_state_dict(model: nn.Module, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
    """Adapter tensors under our names (`layers.0.self_attn.q_proj.lora_A.default.weight`), all adapters
    or one. These are keys of `model.state_dict()`; `load_lora_state_dict` puts them back."""
    if adapter_name is not None and adapter_name not in adapter_names(model):
        raise PosttrainError(f"no adapter {adapter_name!r} (adapters: {', '.join(adapter_names(model)) or 'none'})")
    out: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model).items():
        for adapter in layer.adapter_names():
            if adapter_name is None or adapter == adapter_name:
                out[f"{name}.lora_A.{adapter}.weight"] = layer.lora_A[adapter].weight.detach()
                out[f"{name}.lora_B.{adapter}.weight"] = layer.lora_B[adapter].weight.detach()
    return out


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Copy adapter tensors saved by `lora_state_dict` into the model's existing adapters (exact resume).
    Every tensor of each adapter named in `state` must be there, with the same shape."""
    expected = lora_state_dict(model)
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise CheckpointError(f"{source}: unexpected LoRA tensor {unknown[0]!r} (not an adapter tensor of this model)")
    adapters = {key.split(".lora_")[1].split(".")[1] for key in state}
    missing = sorted(k for k in expected if k.split(".lora_")[1].split(".")[1] in adapters and k not in state)
    if missing:
        raise CheckpointError(f"{source}: missing LoRA tensor {missing[0]!r}")
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{source}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[key].shape)}"
            )
    if merged_adapter(model) in adapters:
        raise PosttrainError(f"cannot load adapter {merged_adapter(model)!r} while it is merged; unmerge it first")
    with torch.no_grad():
        for key, tensor in state.items():
            expected[key].copy_(tensor)

"""PEFT-format LoRA adapters, both ways: `adapter_config.json` + `adapter_model.safetensors`.

A directory written by `save_peft_adapter` loads in `peft.PeftModel.from_pretrained(hf_model, dir)`, and one
written by peft's `save_pretrained` loads here with `load_peft_adapter`. Tensor keys are peft's:
`base_model.model.<HF module name>.lora_{A,B}.weight`, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

Only plain LoRA on Linear layers is read. A config that asks for anything else (DoRA, trained biases,
modules_to_save, layer selection, ...) is refused with the field named, rather than loaded into something
that computes differently from what was trained. Everything is checked before the model is touched.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from posttrain.errors import CheckpointError, PosttrainError
from posttrain.models.checkpoint_io import hf_to_ours, read_json_object, write_dir_atomically
from posttrain.peft.lora import (
    DEFAULT_ADAPTER,
    active_adapter,
    adapter_names,
    check_new_adapter_name,
    find_targets,
    hf_module_name,
    lora_layers,
    matches_spec,
    model_modules,
    set_adapter,
    wrap_linear,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}

# Config fields that do not change what a loaded adapter computes (metadata, runtime options, and settings
# that only matter when peft creates or initialises an adapter, or only together with a refused feature).
INERT_FIELDS = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "peft_version",
        "auto_mapping",
        "inference_mode",
        "runtime_config",
        "megatron_core",
        "qalora_group_size",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "ensure_weight_tying",
    }
)
# Fields read below.
READ_FIELDS = frozenset(
    {
        "peft_type",
        "task_type",
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "exclude_modules",
        "use_rslora",
        "fan_in_fan_out",
        "bias",
        "init_lora_weights",
        "rank_pattern",
        "alpha_pattern",
    }
)
# Known features that must stay off; any other unknown field must be unset too.
FEATURE_NAMES = {
    "use_dora": "DoRA",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "extra modules trained in full",
    "layers_to_transform": "a subset of layers",
    "layers_pattern": "a subset of layers",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on bare parameters",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA",
    "megatron_config": "Megatron parallel layers",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}
# init_lora_weights values that leave the base weights as they were (PiSSA, OLoRA, LoftQ, CorDA, ... rewrite them).
BASE_PRESERVING_INITS = (True, False, "gaussian", "eva", "orthogonal")
TASK_TYPES = (None, "CAUSAL_LM")


@dataclass
class AdapterSpec:
    """What an adapter_config.json means for us."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str] | str
    exclude_modules: list[str] | str | None = None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_and_alpha(self, hf_name: str) -> tuple[int, float]:
        """peft's rule: the first pattern key k with re.match(rf"(.*\\.)?({k})$", name) overrides r / alpha."""
        return _pattern_value(self.rank_pattern, hf_name, self.r), _pattern_value(
            self.alpha_pattern, hf_name, self.alpha
        )


def _unset(value: Any) -> bool:
    """null, false, [], {} or "" (0 is a value: `layers_to_transform: 0` selects layer 0)."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and len(value) == 0)


def _pattern_value(patterns: dict[str, Any], hf_name: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", hf_name):
            return value
    return default


# ---- reading --------------------------------------------------------------------------------------


def read_adapter_config(adapter_dir: str | Path) -> AdapterSpec:
    """Parse and check adapter_config.json; every refusal names the file and the field."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not Path(adapter_dir).is_dir():
        raise CheckpointError(f"{adapter_dir}: no such adapter directory")
    cfg = read_json_object(path, f"{adapter_dir}: no {ADAPTER_CONFIG} (expected a PEFT adapter directory)")

    def fail(key: str, message: str) -> NoReturn:
        raise CheckpointError(f"{path}: {key}={json.dumps(cfg.get(key))} {message}")

    if cfg.get("peft_type") != "LORA":
        fail("peft_type", "is not supported (only LORA adapters load here)")
    if cfg.get("task_type") not in TASK_TYPES:
        fail("task_type", "is not supported (causal language models only: CAUSAL_LM)")
    for key, value in cfg.items():
        if key in READ_FIELDS or key in INERT_FIELDS or _unset(value):
            continue
        feature = FEATURE_NAMES.get(key)
        fail(
            key,
            f"asks for {feature}, which is not supported"
            if feature
            else "is an option this loader does not know; only plain LoRA adapters load here",
        )
    if cfg.get("bias", "none") != "none":
        fail("bias", 'trains base-layer biases, which is not supported (bias must be "none")')
    if cfg.get("init_lora_weights", True) not in BASE_PRESERVING_INITS:
        fail(
            "init_lora_weights",
            "changes the base weights at initialisation (PiSSA/OLoRA/LoftQ/CorDA-style), "
            "which is not supported; convert the adapter to plain LoRA first",
        )
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        fail("r", "must be a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        fail("lora_alpha", "must be a positive number")
    dropout = cfg.get("lora_dropout", 0.0) or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        fail("lora_dropout", "must be in [0, 1)")
    targets = cfg.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        fail("target_modules", "must be a non-empty list of module names or a string")
    exclude = cfg.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, (str, list)):
        fail("exclude_modules", "must be a list of module names or a string")
    if not isinstance(cfg.get("use_rslora", False), bool):
        fail("use_rslora", "must be true or false")
    # fan_in_fan_out=true describes GPT-2 style Conv1D weights; peft ignores it for nn.Linear targets, and so do we.
    patterns = {}
    for key, cast in (("rank_pattern", int), ("alpha_pattern", float)):
        value = cfg.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in value.values()):
            fail(key, "must map module patterns to positive numbers")
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error:
                fail(key, f"has an invalid pattern {pattern!r}")
        patterns[key] = {k: cast(v) for k, v in value.items()}
    if isinstance(targets, str) and targets != "all-linear":
        try:
            re.compile(targets)
        except re.error:
            fail("target_modules", "is not a valid regular expression")
    return AdapterSpec(
        r=r,
        alpha=float(alpha),
        dropout=float(dropout),
        target_modules=targets,
        exclude_modules=exclude or None,
        use_rslora=bool(cfg.get("use_rslora", False)),
        rank_pattern=patterns["rank_pattern"],
        alpha_pattern=patterns["alpha_pattern"],
    )


def read_adapter_tensors(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise CheckpointError(
                f"{adapter_dir}: adapter_model.bin is a pickle, which is never loaded; "
                f"re-save the adapter as {ADAPTER_WEIGHTS} (peft: safe_serialization=True)"
            )
        raise CheckpointError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors (truncated or corrupt: {exc})") from None


def load_peft_adapter(
    model: nn.Module, adapter_dir: str | Path, adapter_name: str = DEFAULT_ADAPTER, trainable: bool = False
) -> nn.Module:
    """Load a PEFT LoRA adapter into `model` under `adapter_name` and make it the active adapter. In place.

    Every other parameter of the model is frozen; the loaded adapter is trainable only if `trainable`
    (to continue training it). Nothing is changed if the adapter fails any check.
    """
    adapter_dir = Path(adapter_dir)
    check_new_adapter_name(model, adapter_name)
    spec = read_adapter_config(adapter_dir)
    tensors = read_adapter_tensors(adapter_dir)
    weights_file = adapter_dir / ADAPTER_WEIGHTS
    targets = find_targets(
        model, spec.target_modules, spec.exclude_modules, str(adapter_dir / ADAPTER_CONFIG), CheckpointError
    )
    pairs = _group_tensors(tensors, model, targets, weights_file)
    for name, (A, B) in pairs.items():  # shapes, before anything is changed
        module = model.get_submodule(name)
        r, _ = spec.rank_and_alpha(hf_module_name(name))
        hf = KEY_PREFIX + hf_module_name(name)
        for part, tensor, expected in (("A", A, (r, module.in_features)), ("B", B, (module.out_features, r))):
            if tuple(tensor.shape) != expected:
                raise CheckpointError(
                    f"{weights_file}: tensor '{hf}.lora_{part}.weight' has shape {tuple(tensor.shape)}, expected "
                    f"{expected} (r={r}, {hf_module_name(name)}: in_features={module.in_features}, "
                    f"out_features={module.out_features})"
                )
            if not tensor.dtype.is_floating_point:
                raise CheckpointError(
                    f"{weights_file}: tensor '{hf}.lora_{part}.weight' has dtype {tensor.dtype}, "
                    "expected a floating-point type"
                )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, (A, B) in pairs.items():
        r, alpha = spec.rank_and_alpha(hf_module_name(name))
        layer = wrap_linear(model, name)
        layer.add_adapter(adapter_name, r, alpha, spec.dropout, spec.use_rslora, trainable=trainable)
        with torch.no_grad():
            layer.lora_A[adapter_name].weight.copy_(A)
            layer.lora_B[adapter_name].weight.copy_(B)
    set_adapter(model, adapter_name)
    return model


def _group_tensors(
    tensors: dict[str, torch.Tensor], model: nn.Module, targets: list[str], source: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """peft keys -> {our module name: (A, B)}, checked against the modules the config targets."""
    modules = model_modules(model)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in LORA_SUFFIXES if key.endswith(s)), None)
        if not key.startswith(KEY_PREFIX) or suffix is None:
            raise CheckpointError(
                f"{source}: unexpected tensor {key!r} (only LoRA lora_A/lora_B weights of Linear "
                f"layers, named '{KEY_PREFIX}<module>.lora_A.weight', are supported)"
            )
        hf_module = key[len(KEY_PREFIX) : -len(suffix)]
        ours = hf_to_ours(hf_module + ".weight")
        name = ours.removesuffix(".weight") if ours is not None else None
        if name not in modules:
            raise CheckpointError(
                f"{source}: tensor {key!r} is for module {hf_module!r}, which the model does not have"
            )
        found.setdefault(name, {})[LORA_SUFFIXES[suffix]] = tensor
    extra = [n for n in found if n not in set(targets)]
    if extra:
        raise CheckpointError(
            f"{source}: tensors for module {hf_module_name(extra[0])!r}, which the config's "
            "target_modules does not select"
        )
    for name in targets:
        for part in ("A", "B"):
            if part not in found.get(name, {}):
                raise CheckpointError(
                    f"{source}: missing tensor '{KEY_PREFIX}{hf_module_name(name)}.lora_{part}.weight'"
                )
    return {name: (found[name]["A"], found[name]["B"]) for name in targets}


# ---- writing --------------------------------------------------------------------------------------


def save_peft_adapter(
    model: nn.Module, out_dir: str | Path, base_model_name_or_path: str | Path, adapter_name: str | None = None
) -> Path:
    """Write adapter `adapter_name` (default: the active one) as a PEFT adapter directory, atomically.

    `base_model_name_or_path` is recorded in adapter_config.json for peft and for `posttrain lora-merge`.
    """
    name = adapter_name or active_adapter(model)
    names = adapter_names(model)
    if name is None and len(names) == 1:
        name = names[0]
    if name is None or name not in names:
        raise PosttrainError(f"no adapter {name!r} to save (adapters: {', '.join(names) or 'none'})")
    layers = {n: layer for n, layer in lora_layers(model).items() if name in layer.lora_A}
    tensors: dict[str, torch.Tensor] = {}
    for n, layer in layers.items():
        prefix = KEY_PREFIX + hf_module_name(n)
        tensors[f"{prefix}.lora_A.weight"] = layer.lora_A[name].weight.detach().to("cpu").contiguous()
        tensors[f"{prefix}.lora_B.weight"] = layer.lora_B[name].weight.detach().to("cpu").contiguous()
    config = _peft_config(model, layers, name, str(base_model_name_or_path))
    return _write_atomically(
        Path(out_dir),
        {
            ADAPTER_CONFIG: lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
            ADAPTER_WEIGHTS: lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        },
    )


def _peft_config(model: nn.Module, layers: dict[str, Any], name: str, base: str) -> dict[str, Any]:
    rslora = {layer.use_rslora[name] for layer in layers.values()}
    dropouts = {getattr(layer.lora_dropout[name], "p", 0.0) for layer in layers.values()}
    if len(rslora) > 1 or len(dropouts) > 1:
        raise PosttrainError(f"adapter {name!r} mixes use_rslora or dropout across layers; peft stores one value")
    ranks = {n: layer.r[name] for n, layer in layers.items()}
    alphas = {n: layer.alpha[name] for n, layer in layers.items()}
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    # peft's target list matches a module equal to or ending with an entry: leaf names when they select
    # exactly our layers, else the full HF names.
    leaves = sorted({n.rsplit(".", 1)[-1] for n in layers})
    selected_by_leaves = {n for n in model_modules(model) if matches_spec(leaves, hf_module_name(n))}
    targets = leaves if selected_by_leaves == set(layers) else sorted(hf_module_name(n) for n in layers)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "revision": None,
        "r": r,
        "lora_alpha": _number(alpha),
        "lora_dropout": dropouts.pop(),
        "target_modules": targets,
        "exclude_modules": None,
        "use_rslora": rslora.pop(),
        "rank_pattern": {re.escape(hf_module_name(n)): v for n, v in ranks.items() if v != r},
        "alpha_pattern": {re.escape(hf_module_name(n)): _number(v) for n, v in alphas.items() if v != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "use_dora": False,
        "lora_bias": False,
        "inference_mode": True,
    }


def _number(x: float) -> int | float:
    return int(x) if math.isfinite(x) and float(x).is_integer() else x


def _write_atomically(out: Path, writers: dict[str, Any]) -> Path:
    """Each writer writes its file into the new directory, which replaces `out` only once complete."""

    def fill(tmp: Path) -> None:
        for filename, write in writers.items():
            write(tmp / filename)

    return write_dir_atomically(out, fill)

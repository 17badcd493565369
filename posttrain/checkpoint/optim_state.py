"""An optimizer's and a schedule's state as tensors plus plain JSON, so a checkpoint needs no pickle.

`optimizer.state_dict()` is {"state": {param index: {name: tensor or number}}, "param_groups": [...]}.
Its tensors (AdamW's exp_avg, exp_avg_sq, step) go to a safetensors file under `state.<index>.<name>`;
everything else (numbers, the groups' hyper-parameters) is JSON, with each tensor replaced by its key.
Tensors keep their dtype, so a round trip is bitwise.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from posttrain.errors import CheckpointError

_TENSOR_REF = "__tensor__"


def optimizer_to_plain(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able skeleton, tensors) of `optimizer.state_dict()`."""
    saved = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, entries in saved["state"].items():
        plain: dict[str, Any] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                key = f"state.{index}.{name}"
                tensors[key] = value.detach().to("cpu").contiguous()
                plain[name] = {_TENSOR_REF: key}
            else:
                plain[name] = _checked_json(value, f"optimizer state {index}.{name}")
        state[str(index)] = plain
    groups = [_checked_json(group, "optimizer param_groups") for group in saved["param_groups"]]
    return {"state": state, "param_groups": groups}, tensors


def load_optimizer_plain(
    optimizer: torch.optim.Optimizer, plain: dict[str, Any], tensors: dict[str, torch.Tensor], source: str
) -> None:
    """Put a state written by `optimizer_to_plain` back into `optimizer` (built the same way, over the same
    parameters). torch moves each tensor to its parameter's device."""
    try:
        state = {
            int(index): {name: _resolve(value, tensors, source) for name, value in entries.items()}
            for index, entries in plain["state"].items()
        }
        groups = plain["param_groups"]
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{source}: not an optimizer state ({error!r})") from None
    live = optimizer.param_groups
    if len(groups) != len(live) or any(len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, live)):
        raise CheckpointError(
            f"{source}: the optimizer state has {[len(g['params']) for g in groups]} parameters per group, this "
            f"run's optimizer {[len(mine['params']) for mine in live]} (a different model, LoRA config or head?)"
        )
    # JSON has no tuples: give back the live type (AdamW's betas) so the groups compare equal after loading.
    groups = [
        {k: tuple(v) if isinstance(mine.get(k), tuple) and isinstance(v, list) else v for k, v in g.items()}
        for g, mine in zip(groups, live)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def scheduler_to_plain(scheduler: Any) -> dict[str, Any]:
    """A schedule's state_dict as JSON (LambdaLR: step count and last lrs; its lambda is rebuilt from the config)."""
    return _checked_json(scheduler.state_dict(), "scheduler state")


def _resolve(value: Any, tensors: dict[str, torch.Tensor], source: str) -> Any:
    if isinstance(value, dict) and _TENSOR_REF in value:
        key = value[_TENSOR_REF]
        if key not in tensors:
            raise CheckpointError(f"{source}: optimizer tensor {key!r} is missing")
        return tensors[key]
    return value


def _checked_json(value: Any, what: str) -> Any:
    """`value` itself when it survives a JSON round trip unchanged (tuples become lists), else an error:
    a state that JSON cannot hold would need pickle, which checkpoints never use."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what} is not plain data ({error}); it cannot be checkpointed without pickle") from None
    back = json.loads(text)
    if not _same(back, value):
        raise CheckpointError(f"{what} does not survive JSON unchanged: {text[:200]}")
    return back


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, tuple):
        b = list(b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b

"""LinearMode: a TorchFunctionMode that hands every F.linear call inside it to another implementation first.

The engine's weight copies (packed_weights.py: MKL-packed fp32; bf16_weights.py: bf16 copies over fp32 master
weights) run the model's linear layers (nn.Linear, LoRA's layers, the LM head) their own way without touching the
model code: the runner enters one such mode around its forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# (x, weight, bias) -> F.linear's result computed another way, or None where that way does not take this call
LinearRoute = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


class LinearMode(TorchFunctionMode):
    """Routes F.linear through `route`; where it returns None, and for every other function, runs the call as it
    would. (Inside `__torch_function__` the mode is off, so `route` may call F.linear itself.)"""

    def __init__(self, route: LinearRoute) -> None:
        super().__init__()
        self.route = route

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        if func is F.linear:
            # F.linear(input, weight, bias=None): any of them may come by keyword
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = self.route(x, weight, bias)
            if out is not None:
                return out
        return func(*args, **kwargs)

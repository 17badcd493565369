"""Quantize a whole decoder with GPTQ, one layer at a time, on calibration text.

    ids = calibration_batch(token_rows, num_samples=128, seq_len=512, separator=tokenizer.eos_token_id)
    gptq_quantize_model(model, "int4-g128", ids)   # act_order, clip_search and true_sequential on by default

The walk: embed the calibration sequences once, then for each decoder layer
1. run it in float over every sequence, with hooks that accumulate H = X^T X / M for the input X of each
   linear layer (q/k/v read the same input, as do gate/up: one H serves them);
2. GPTQ-round each of its linears (`gptq.gptq_quantize`) and put QuantizedLinears in their place;
3. run the now-quantized layer again: its outputs, carrying its rounding error, are the next layer's inputs,
   so each layer corrects for the error of the layers before it.
Only the hidden states of the calibration set, (S, T, d), live between layers: the model is never run end to
end. The same layers as `quantize_model` are converted (the decoder linears; lm_head and embeddings stay).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain.errors import PosttrainError
from posttrain.models.attention import DenseAttentionMetadata
from posttrain.quant.gptq import gptq_quantize
from posttrain.quant.linear import QuantizedLinear, check_compute, decoder_linear_names, replace_module
from posttrain.quant.schemes import QuantScheme, get_scheme


def calibration_batch(
    token_rows: Sequence[Sequence[int]], num_samples: int, seq_len: int, separator: int | None = None
) -> torch.Tensor:
    """Token rows -> (S, seq_len) ids: the rows joined end to end (with `separator` between them) and cut
    into consecutive windows, S = min(num_samples, available windows). Rows run across window edges, as in
    the GPTQ paper's random windows of a long corpus; no padding is needed."""
    if num_samples < 1 or seq_len < 2:
        raise PosttrainError(f"calibration needs num_samples >= 1 and seq_len >= 2 (got {num_samples}, {seq_len})")
    stream: list[int] = []
    for row in token_rows:
        stream.extend(row)
        if separator is not None:
            stream.append(separator)
        if len(stream) >= num_samples * seq_len:
            break
    windows = min(num_samples, len(stream) // seq_len)
    if windows == 0:
        raise PosttrainError(
            f"calibration text has {len(stream)} tokens, fewer than one window of {seq_len} "
            "(more rows or a shorter --calib-seq-len)"
        )
    return torch.tensor(stream[: windows * seq_len], dtype=torch.long).view(windows, seq_len)


class _StopForward(Exception):
    """Raised by a hook once every linear of interest has seen its input: the rest of the layer's forward
    would be wasted work."""


class _HessianCollector:
    """Forward hooks that sum x^T x over the inputs of chosen linears. Linears fed the very same tensor in
    one forward (q/k/v; gate/up) share one sum: it is computed once. With `stop`, the forward is cut short
    (_StopForward) as soon as all of them have run."""

    def __init__(self, modules: dict[str, nn.Linear], stop: bool = False) -> None:
        self.stop, self.pending = stop, set(modules)
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.alias: dict[str, str] = {}  # linear -> the linear whose sum it shares
        # (data_ptr, shape) of an input this forward -> (the first linear fed it, the input). The input is held until
        # the forward ends: a tensor freed mid-forward (q/k/v's normed input) could otherwise hand its address to a
        # later input of the same shape (o_proj's), which would then read as "the same tensor" and share q's sum
        # (a GPTQ worse than round-to-nearest, depending on the allocator).
        self._seen: dict[tuple, tuple[str, torch.Tensor]] = {}
        self._ran: set[str] = set()  # linears that ran in this forward
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            x = inputs[0]
            key = (x.data_ptr(), tuple(x.shape))
            owner, _ = self._seen.setdefault(key, (name, x))
            self._ran.add(name)
            if owner != name:
                self.alias[name] = owner
            else:
                self._accumulate(name, x)
            if self.stop and self._ran >= self.pending:
                raise _StopForward

        return hook

    def _accumulate(self, name: str, x: torch.Tensor) -> None:
        x2d = x.detach().reshape(-1, x.shape[-1]).float()  # (M, K)
        if name not in self.sums:
            self.sums[name] = torch.zeros(x2d.shape[1], x2d.shape[1], dtype=torch.float64)
            self.rows[name] = 0
        self.sums[name] += (x2d.T @ x2d).double()  # (K, K); fp64 sum: millions of rows
        self.rows[name] += x2d.shape[0]

    def new_forward(self) -> None:
        self._seen.clear()  # tensors of the last forward are let go; their addresses may be reused
        self._ran.clear()

    def hessian(self, name: str) -> torch.Tensor:
        owner = self.alias.get(name, name)
        if owner not in self.sums:
            raise PosttrainError(f"{name}: the layer never ran on the calibration inputs")
        return self.sums[owner] / self.rows[owner]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._seen.clear()


def _stages(linears: dict[str, nn.Module], run: Callable[[_HessianCollector], None]) -> list[list[str]]:
    """The linears of one layer in the order they run, those fed the same input in one stage:
    [[q, k, v], [o], [gate, up], [down]] for a Llama layer. `run` runs the layer on one batch."""
    order: list[tuple[str, tuple]] = []

    def record(name: str):
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            order.append((name, (inputs[0].data_ptr(), tuple(inputs[0].shape))))

        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in linears.items()]
    try:
        run(_HessianCollector({}))
    finally:
        for handle in handles:
            handle.remove()
    stages: list[list[str]] = []
    previous = None
    for name, key in order:
        if key != previous:
            stages.append([])
        stages[-1].append(name)
        previous = key
    return stages


@torch.no_grad()
def gptq_quantize_model(
    model: nn.Module,
    scheme: str | QuantScheme,
    calibration_ids: torch.Tensor,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    clip_search: bool = True,
    true_sequential: bool = True,
    batch_size: int = 8,
    compute: str = "auto",
    progress: bool = False,
) -> dict[str, float]:
    """Replace every decoder linear with a GPTQ-rounded QuantizedLinear, in place; calibration_ids (S, T).

    `true_sequential`: within a layer, quantize in the order the linears run (q/k/v, then o, then gate/up,
    then down), collecting each one's inputs with the ones before it already quantized; otherwise all
    from one float forward (faster, slightly less accurate).
    Returns the GPTQ proxy loss of each layer by name (the output error it minimised; for comparing runs).
    The saved config's `quantization_config` records the method and its settings.
    """
    scheme = get_scheme(scheme)
    check_compute(compute)
    if calibration_ids.dim() != 2 or calibration_ids.dtype != torch.long:
        raise PosttrainError(
            f"calibration_ids must be (samples, seq_len) int64, got {tuple(calibration_ids.shape)} "
            f"{calibration_ids.dtype}"
        )
    names = decoder_linear_names(model)
    if not names:
        raise PosttrainError("gptq: the model has no decoder linear layers (layers.N.self_attn.q_proj ...)")
    for name in names:
        if type(model.get_submodule(name)) is not nn.Linear:
            raise PosttrainError(
                f"gptq: {name} is a {type(model.get_submodule(name)).__name__}, not nn.Linear "
                "(quantize a float model, before applying LoRA or QAT)"
            )
    device = model.embed_tokens.weight.device
    ids = calibration_ids.to(device)
    S, T = ids.shape
    batches = [slice(start, min(start + batch_size, S)) for start in range(0, S, batch_size)]
    hidden = torch.cat([model.embed_tokens(ids[b]) for b in batches])  # (S, T, d)
    positions = torch.arange(T, device=device)[None, :]  # (1, T): every window starts at position 0
    cos, sin = model.rotary(positions)
    meta = DenseAttentionMetadata(None, positions)  # plain causal
    losses: dict[str, float] = {}
    from tqdm.auto import tqdm

    def run_layer(layer: nn.Module, collector: _HessianCollector, which: list[slice] = batches) -> None:
        for b in which:
            collector.new_forward()
            try:
                layer(hidden[b], cos, sin, meta)
            except _StopForward:
                pass

    for index in tqdm(range(len(model.layers)), desc="gptq", unit="layer", disable=not progress, dynamic_ncols=True):
        layer = model.layers[index]
        prefix = f"layers.{index}."
        mine = {name: model.get_submodule(name) for name in names if name.startswith(prefix)}
        for stage in _stages(mine, lambda c: run_layer(layer, c, batches[:1])) if true_sequential else [list(mine)]:  # noqa: B023 (called in this iteration)
            collector = _HessianCollector({name: mine[name] for name in stage}, stop=true_sequential)
            try:
                run_layer(layer, collector)
            finally:
                collector.close()
            for name in stage:
                linear = mine[name]
                result = gptq_quantize(
                    linear.weight,
                    collector.hessian(name),
                    scheme,
                    damp,
                    block_size,
                    act_order,
                    clip_search,
                    source=name,
                )
                losses[name] = result.proxy_loss
                quantized = QuantizedLinear.from_codes(
                    result.codes, result.scales, result.zeros, linear.bias, scheme, "reference", source=name
                )
                replace_module(model, name, quantized.to(device))
        for b in batches:  # the next layer sees this layer's quantized outputs
            hidden[b] = layer(hidden[b], cos, sin, meta)
        for name in mine:
            model.get_submodule(name).compute = compute
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "extra"):
        config.extra["quantization_config"] = {
            **scheme.to_config(),
            "method": "gptq",
            "gptq": {
                "damp": damp,
                "block_size": block_size,
                "act_order": act_order,
                "clip_search": clip_search,
                "true_sequential": true_sequential,
                "calibration_samples": S,
                "calibration_seq_len": T,
            },
        }
    return losses

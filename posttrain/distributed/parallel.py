"""Wrapping the model for data parallelism (DDP or FSDP2), and the per-step pieces a trainer needs from it.

The trainers compute their losses by calling model methods (`hidden_states`, `lm_head.weight`, ...), not
`model(...)`. DDP and FSDP2 both act in hooks around a module's `__call__` (DDP prepares its gradient
reducer there; FSDP2's root gathers the parameters that no layer group owns: embeddings, final norm, LM
head). So the wrapped module is a thin `_Call` around the model whose forward is `fn(model, *args)`:
`parallel.run(sft_loss_sum, batch)` goes through the wrapper's hooks and then runs the trainer's own
function on the real model.

Gradient scale: DDP and FSDP2 *average* the gradients over the ranks. A trainer divides each rank's summed
loss by the GLOBAL count (tokens, pairs; all-reduced), so the gradient of the global mean is the *sum* of
the ranks' gradients; `loss_scale` (= world size) turns the average back into that sum. 2 ranks x B/2 rows
then give the update of 1 rank x B rows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint
from torch import nn

from posttrain.distributed.config import DistSection
from posttrain.distributed.env import DistContext
from posttrain.distributed.export import meta_skeleton, whole_copy
from posttrain.distributed.lockstep import Lockstep
from posttrain.errors import ConfigError

logger = logging.getLogger("posttrain.distributed")

T = TypeVar("T")


class _Call(nn.Module):
    """The module DDP / FSDP2 wrap: `forward(fn, *args)` is `fn(model, *args)`, inside their hooks. `beside`:
    modules trained next to the model (a reward model's score head), registered here so that their gradients
    are reduced with the model's."""

    def __init__(self, model: nn.Module, beside: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.model = model
        self.beside = nn.ModuleDict(beside or {})

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.model, *args)


def _nothing(model: nn.Module) -> None:
    return None


def checkpoint_layers(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant torch.utils.checkpoint).

    The layer's `forward` is replaced on the instance, so parameter names (and the checkpoints written
    under them) stay the same; FSDP2's hooks stay on the layer module around it."""
    for layer in model.layers:
        inner = layer.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


class Parallel:
    """The model as the strategy spreads it over the ranks; `model` stays the real `Transformer` (whose
    parameters are DTensor shards under fsdp2), `run` calls through the wrapper."""

    def __init__(
        self,
        model: nn.Module,
        section: DistSection,
        ctx: DistContext,
        *,
        beside: dict[str, nn.Module] | None = None,
        unused_parameters: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`beside`: modules trained next to the model, whose gradients are reduced with it (ddp: in DDP's buckets;
        fsdp2: sharded by the root group, beside the embeddings). `unused_parameters`: some trainable parameters
        get no gradient in a step (DDP must look for them). `compute_dtype`: run the forwards under autocast to
        it over the model's own (master) weights, e.g. bf16 on a CPU with fast bf16 (`model.dtype: auto`)."""
        self.model, self.section, self.ctx = model, section, ctx
        self.strategy = section.strategy
        device = next(model.parameters()).device
        self.autocast = section.mixed_precision and self._mixed_precision_usable(model, device)
        # (device type, dtype) of the autocast around every forward; None: none (the weights' own dtype).
        self.compute_autocast: tuple[str, torch.dtype] | None = None
        if compute_dtype is not None:
            self.compute_autocast = (device.type, compute_dtype)
        # fsdp2: the structure of each module, for gathering it whole later (`whole`); taken before the layers'
        # forwards are wrapped for checkpointing and before fully_shard turns the Parameters into shards.
        self._skeletons: dict[int, nn.Module] = {}
        if self.strategy == "fsdp2":
            self._skeletons = {id(m): meta_skeleton(m) for m in (model, *(beside or {}).values())}
        if section.activation_checkpointing:
            checkpoint_layers(model)
        self.wrapped: nn.Module | None = None
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # device_ids=None: the inputs are already on the rank's device; buffers (rotary tables) are
            # computed, not trained, so they need no broadcast before every forward.
            self.wrapped = DistributedDataParallel(
                _Call(model, beside),
                device_ids=None,
                forward_sync_buffers=False,
                find_unused_parameters=unused_parameters,
            )
        elif self.strategy == "fsdp2":
            self.wrapped = self._fully_shard(model, beside)
            self.autocast = False  # FSDP2's own MixedPrecisionPolicy casts the gathered parameters
        if self.autocast:
            self.compute_autocast = ("cuda", torch.bfloat16)

    def _mixed_precision_usable(self, model: nn.Module, device: torch.device) -> bool:
        if device.type != "cuda":
            logger.warning(
                "dist.mixed_precision=true needs CUDA devices (bf16 compute); on %s the run stays fp32", device.type
            )
            return False
        dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            raise ConfigError(
                f"dist.mixed_precision=true keeps fp32 master weights, but the model loaded as {dtype}: "
                "set model.dtype=float32"
            )
        return True

    def _fully_shard(self, model: nn.Module, beside: dict[str, nn.Module] | None) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy()
        if self.autocast:  # resolved above: CUDA with fp32 master weights
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        reshard = self.section.reshard_after_forward
        # One group per decoder layer: only one layer's full weights exist at a time (with reshard=true).
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
        # The root group owns the rest (embeddings, tied LM head, final norm, and the modules trained beside the
        # model: a score or value head); it is used again right after the forward by the loss, so it is never
        # resharded in between. The heads are called inside the root's forward (`run`), where their Parameters
        # are the gathered whole ones, and their gradients are reduce-scattered with the embeddings'.
        root = fully_shard(_Call(model, beside), reshard_after_forward=False, mp_policy=mp)
        # One call through the root now initialises FSDP's state with the root as root. Otherwise the first
        # forward that reaches a layer directly (the rollout engine's, see `full_weights`) would make that
        # layer a root of its own. Every rank does it here, together (it gathers the root's parameters).
        with torch.no_grad():
            root(_nothing)
        root.reshard()  # type: ignore[operator]  # the root's Parameters are its shards again (the optimizer's)
        if self.section.rollout_weights == "per_layer":
            # FSDP2 creates a group's full-size parameter buffers at its first all-gather and reuses them after.
            # Made inside the engine's inference mode (its first layer-by-layer forward), they would be inference
            # tensors, which the training forward's gather may not write into: make them now, one layer at a time.
            for layer in model.layers:
                layer.unshard()
                layer.reshard()
        return root

    def whole(self, module: nn.Module) -> nn.Module | None:
        """`module` (the model or one of the `beside` modules) with whole weights: itself unless sharded; under
        fsdp2 a CPU copy of the same structure on rank 0 and None elsewhere (collective: every rank calls it)."""
        if self.strategy != "fsdp2":
            return module
        return whole_copy(module, self._skeletons[id(module)])

    @property
    def world(self) -> int:
        """The ranks the batch is split over: the world size when wrapped, 1 with strategy none."""
        return self.ctx.world_size if self.wrapped is not None else 1

    @property
    def loss_scale(self) -> float:
        """Multiply each rank's globally-normalised loss by this before backward (see the module docstring)."""
        return float(self.world)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(model, *args)` through the DDP / FSDP2 hooks (a plain call with strategy none)."""
        with self.compute():
            if self.wrapped is None:
                return fn(self.model, *args)
            out = self.wrapped(fn, *args)
        if self.strategy == "fsdp2" and not torch.is_grad_enabled():
            # FSDP2 reshards the root's parameters in the backward; a no-grad pass (evaluation, a scoring pass)
            # has none, and would leave the whole parameters registered where the optimizer and checkpoints
            # expect the shards.
            self.wrapped.reshard()  # type: ignore[operator]
        return out

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast every forward of the run computes under (a no-op without one)."""
        if self.compute_autocast is None:
            return contextlib.nullcontext()
        return compute_scope(*self.compute_autocast)

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Around a micro-batch's forward and backward: with `enabled` false (every micro-batch of the step but
        the last) the gradients only accumulate locally; the last one reduces the accumulated sum once."""
        if self.strategy == "ddp" and not enabled:
            with self.wrapped.no_sync():  # type: ignore[union-attr]
                yield
        elif self.strategy == "fsdp2":
            self.wrapped.set_requires_gradient_sync(enabled)  # type: ignore[union-attr]
            try:
                yield
            finally:
                self.wrapped.set_requires_gradient_sync(True)  # type: ignore[union-attr]
        else:
            yield

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """Inside: every parameter of the model whole on every rank (FSDP2 all-gathers them once; a no-op for
        the other strategies). For work the ranks do each on their own, without lockstep collectives: the
        rollout engine, whose ranks run different numbers of forwards. Costs a full copy of the weights per
        rank for its duration; they are resharded (freed) on the way out."""
        if self.strategy != "fsdp2":
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        root = self.wrapped
        groups = [m for m in root.modules() if isinstance(m, FSDPModule)]  # type: ignore[union-attr]
        # The engine calls the layers themselves, so their FSDP hooks run: with everything already gathered their
        # pre-forward gather is a no-op, and with resharding after forward off their post-forward frees nothing,
        # so no rank waits on another while each generates at its own pace.
        root.set_reshard_after_forward(False)  # type: ignore[union-attr]
        for group in groups:
            group.unshard()
        try:
            yield
        finally:
            for group in groups:
                group.reshard()
            for layer in self.model.layers:
                layer.set_reshard_after_forward(self.section.reshard_after_forward, recurse=False)

    @contextlib.contextmanager
    def rollout(self) -> Iterator[Lockstep]:
        """Around a rollout (every engine call over the live model), on every rank together: the weights as
        `dist.rollout_weights` says. Yields the `Lockstep` to put each engine call in (`with lockstep(): ...`);
        it is off (a no-op) except with per_layer."""
        if self.section.rollout_weights != "per_layer" or self.strategy != "fsdp2":
            with self.full_weights():
                yield Lockstep.off()
            return
        with self._layer_by_layer() as lockstep:
            yield lockstep

    @contextlib.contextmanager
    def _layer_by_layer(self) -> Iterator[Lockstep]:
        """The root group's parameters (embeddings, tied LM head, final norm, a value head) whole throughout;
        each decoder layer gathered by its own pre-forward hook and freed after its forward, so at most one
        layer's full weights exist at a time beside the root's."""
        root, layers = self.wrapped, list(self.model.layers)
        root.unshard()  # type: ignore[union-attr]  # the root group only: the layers are groups of their own
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
        try:
            yield Lockstep(layers, next(iter(root.parameters())).device)  # type: ignore[union-attr]
        finally:
            root.reshard()  # type: ignore[union-attr]
            for layer in layers:
                layer.set_reshard_after_forward(self.section.reshard_after_forward, recurse=False)

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of a global batch: items rank, rank + W, rank + 2W, ... (strided, so rows of
        similar position, which a length-sorted source makes similar in length, spread over the ranks)."""
        return list(items[self.ctx.rank :: self.ctx.world_size])

    def check_divides(self, key: str, value: int) -> None:
        """Every rank must get the same number of rows per micro-batch (FSDP2 gathers in lockstep)."""
        if value % self.ctx.world_size:
            raise ConfigError(
                f"{key}={value} is the global batch; it must divide evenly over the {self.ctx.world_size} processes"
            )


def compute_scope(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """The autocast a run with `compute_dtype=dtype` computes its forwards under (`Parallel.compute`), for passes
    made before the Parallel exists (a precomputed reference); a no-op for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def run_module(parallel: Parallel | None, module: nn.Module, fn: Callable[..., T], *args: Any) -> T:
    """`fn(module, *args)`: through `parallel`'s DDP / FSDP2 hooks when `module` is the model it wraps (under
    FSDP2 its weights are whole only inside them), a plain call otherwise (one process, or a frozen copy)."""
    if parallel is not None and module is parallel.model:
        return parallel.run(fn, *args)
    with parallel.compute() if parallel is not None else contextlib.nullcontext():  # a frozen copy computes alike
        return fn(module, *args)

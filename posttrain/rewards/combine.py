"""Several reward functions on one batch -> one weighted reward per sample.

Unscorable samples. A function returns None (or NaN) for a sample it cannot score; a function that
raises marks every sample of the batch unscorable for that function (its message is kept in
`RewardResult.errors`; the exception is logged, with its traceback, the first time that spec's function
raises and not again: a spec lives for one run, shared by its training and evaluation batches, so a
reward that fails on every batch warns once per run, as docs/rewards.md says). A sample is unscorable — total NaN — if ANY
function with a non-zero weight could not score it: a partial sum would silently change what the
reward means for that sample. Weight-0 functions are computed and reported in `per_function` (for
metrics) but take no part in the total nor in the unscorable decision. The RL advantage code
(`posttrain.algos`) leaves NaN rewards out of its statistics and gives them advantage 0.

Async functions are awaited concurrently (one asyncio event loop per call, in a helper thread if the
caller is already inside a running loop). Sync functions run one after the other, first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.rewards.base import RewardError, RewardFn
from posttrain.rewards.signature import FIXED_ARGUMENTS, check_reward_signature

logger = logging.getLogger(__name__)

MAX_ERRORS_KEPT = 5


class _FailureLog:
    """Whether a spec's function has raised yet; only that first failure is logged with a warning."""

    __slots__ = ("logged",)

    def __init__(self) -> None:
        self.logged = False


@dataclass(frozen=True)
class RewardSpec:
    """A reward function under a name (the key in metrics) with its weight in the total."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    # Mutable inside the frozen spec: the spec is built once per run (trainer or eval, from its config).
    _failures: _FailureLog = field(default_factory=_FailureLog, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RewardError(f"RewardSpec.name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise RewardError(f"RewardSpec {self.name!r}: fn is a {type(self.fn).__name__}, not callable")
        if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
            raise RewardError(f"RewardSpec {self.name!r}: weight must be a finite number, got {self.weight!r}")


@dataclass
class RewardResult:
    """Rewards of one batch. total (B,) float32 is the weighted sum, NaN where unscorable;
    per_function maps each spec name to its raw (unweighted) rewards (B,), NaN where it could not score."""

    total: torch.Tensor  # (B,) float32
    per_function: dict[str, torch.Tensor]  # name -> (B,) float32
    num_unscorable: int
    errors: list[str] = field(default_factory=list)

    @property
    def scorable(self) -> torch.Tensor:
        """(B,) bool: samples with a finite total."""
        return ~torch.isnan(self.total)

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Batch means over scorable samples (NaN when none), plus the unscorable fraction, for logging."""
        out = {f"{prefix}/mean": _nanmean(self.total)}
        for name, values in self.per_function.items():
            out[f"{prefix}/{name}/mean"] = _nanmean(values)
        out[f"{prefix}/unscorable_frac"] = self.num_unscorable / max(1, self.total.numel())
        return out


def _nanmean(values: torch.Tensor) -> float:
    return float(torch.nanmean(values)) if values.numel() else float("nan")


def compute_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> RewardResult:
    """Call every reward function once on the batch and combine them (see the module docstring).

    Raises RewardError, before calling anything, for bad specs, mismatched batch sizes, a column of the
    wrong length or a signature that cannot take the call; and after a call, for a function that
    returns something other than B numbers / None (naming the function).
    """
    columns = dict(columns or {})
    batch_size = _validate_batch(specs, prompts, completions, columns)
    for spec in specs:
        check_reward_signature(spec.fn, spec.name, columns)
    kwargs: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions), **columns}

    raw: dict[str, Any] = {}
    failures: dict[str, BaseException] = {}
    pending: dict[str, Any] = {}
    for spec in specs:
        try:
            out = spec.fn(**kwargs)
        except Exception as error:
            failures[spec.name] = error
            continue
        if inspect.isawaitable(out):
            pending[spec.name] = out
        else:
            raw[spec.name] = out
    if pending:
        for name, out in zip(pending, _await_all(list(pending.values()))):
            if isinstance(out, BaseException):
                failures[name] = out
            else:
                raw[name] = out

    per_function: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    for spec in specs:  # in spec order, so results and messages are deterministic
        if spec.name in failures:
            error = failures[spec.name]
            _log_failure(spec, batch_size, error)
            if len(errors) < MAX_ERRORS_KEPT:
                errors.append(f"{spec.name}: {type(error).__name__}: {error}")
            per_function[spec.name] = torch.full((batch_size,), float("nan"))
        else:
            per_function[spec.name] = _as_tensor(spec.name, raw[spec.name], batch_size)

    total = torch.zeros(batch_size, dtype=torch.float64)  # (B,)
    for spec in specs:
        if spec.weight != 0:
            total += spec.weight * per_function[spec.name].double()  # NaN propagates: unscorable
    total = total.float()
    return RewardResult(total, per_function, int(torch.isnan(total).sum()), errors)


def _log_failure(spec: RewardSpec, batch_size: int, error: BaseException) -> None:
    """A warning with the traceback the first time `spec` raises; later failures only at debug level."""
    if spec._failures.logged:
        logger.debug(
            "reward %r raised again on a batch of %d samples: %s: %s",
            spec.name,
            batch_size,
            type(error).__name__,
            error,
        )
        return
    spec._failures.logged = True
    logger.warning(
        "reward %r raised on a batch of %d samples; they are unscorable for it (shown once: later "
        "failures of this reward are not logged again, but still count as unscorable): %s: %s",
        spec.name,
        batch_size,
        type(error).__name__,
        error,
        exc_info=error,
    )


def _validate_batch(
    specs: Sequence[RewardSpec], prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Sequence[Any]]
) -> int:
    if not specs:
        raise RewardError("compute_rewards: no reward functions given")
    names = [spec.name for spec in specs]
    for spec in specs:
        if not isinstance(spec, RewardSpec):
            raise RewardError(f"compute_rewards: specs must be RewardSpec, got {type(spec).__name__}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RewardError(f"compute_rewards: reward names must be unique, repeated: {', '.join(duplicates)}")
    if all(spec.weight == 0 for spec in specs):
        raise RewardError("compute_rewards: every reward has weight 0, so there is no total to compute")
    batch_size = len(completions)
    if len(prompts) != batch_size:
        raise RewardError(f"compute_rewards: {len(prompts)} prompts but {batch_size} completions")
    for key, values in columns.items():
        if key in FIXED_ARGUMENTS:
            raise RewardError(f"compute_rewards: column {key!r} clashes with the reward argument of that name")
        if not hasattr(values, "__len__") or isinstance(values, (str, bytes)):
            raise RewardError(
                f"compute_rewards: column {key!r} must be a list aligned with the batch, got {type(values).__name__}"
            )
        if len(values) != batch_size:
            raise RewardError(f"compute_rewards: column {key!r} has {len(values)} values for a batch of {batch_size}")
    return batch_size


def _as_tensor(name: str, values: Any, batch_size: int) -> torch.Tensor:
    """A function's return value -> (B,) float32 with NaN for None/NaN, or RewardError naming the function."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist() if values.dim() <= 1 else values
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"reward {name!r} returned a {type(values).__name__}; expected a list of {batch_size} "
            f"floats (None for unscorable samples)"
        )
    if len(values) != batch_size:
        raise RewardError(f"reward {name!r} returned {len(values)} values for a batch of {batch_size}")
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {name!r} returned a {type(value).__name__} at index {i}; expected a float or None"
            )
        value = float(value)
        if math.isinf(value):
            raise RewardError(
                f"reward {name!r} returned {value} at index {i}; rewards must be finite (None if unscorable)"
            )
        out.append(value)
    return torch.tensor(out, dtype=torch.float32)  # (B,)


def _await_all(awaitables: list[Any]) -> list[Any]:
    """Await every awaitable concurrently; an exception comes back in its slot instead of being raised."""

    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:  # already inside a loop: use another
        return pool.submit(asyncio.run, gather()).result()

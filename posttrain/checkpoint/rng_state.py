"""Every random generator a training step may draw from, captured and restored for exact resume.

Python's `random`, NumPy's legacy global generator, torch's CPU generator and the generator of every
CUDA device. What a step draws from them (dropout, LoRA dropout, an epoch's reshuffle, the rollout
engine's unseeded samples) is then the same after a resume as in a run that never stopped.

The state comes in two parts so that nothing needs pickling: plain JSON (Python's and NumPy's
Mersenne-Twister words as int lists) and uint8 tensors (torch's states) for a safetensors file.

Under torchrun every rank has its own streams (RL seeds rank r's with `train.seed + r`, so the ranks'
unseeded samples differ). A checkpoint holds each rank's (`capture_rank_rngs`, gathered to every rank) and a
resume on the same world size gives each rank back its own. On another world size rank r < N (the ranks
saved) takes saved rank r's streams, and the ranks beyond keep the streams they were seeded with at start:
the run goes on, with a warning, but its random draws are not the uninterrupted run's.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from posttrain.distributed.env import all_gather_objects
from posttrain.errors import CheckpointError

logger = logging.getLogger("posttrain.trainers")

_CPU = "torch_cpu"
_CUDA = "torch_cuda."  # + device index


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able states of python / numpy, torch generator states as uint8 tensors)."""
    version, words, gauss = random.getstate()
    plain: dict[str, Any] = {"python": [version, list(words), gauss]}
    try:
        import numpy

        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        plain["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    tensors = {_CPU: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_CUDA}{index}"] = state
    return plain, tensors


def restore_rng(plain: dict[str, Any], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Put back what `capture_rng` returned. A CUDA state is restored on every device saved that exists
    here; a run resumed on fewer devices than it was saved on is refused (its draws would differ)."""
    try:
        version, words, gauss = plain["python"]
        random.setstate((version, tuple(words), gauss))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: bad python RNG state ({error})") from None
    if "numpy" in plain:
        import numpy

        name, keys, pos, has_gauss, cached = plain["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    if _CPU not in tensors:
        raise CheckpointError(f"{source}: no torch CPU RNG state")
    torch.set_rng_state(tensors[_CPU])
    cuda = sorted((int(k[len(_CUDA) :]), v) for k, v in tensors.items() if k.startswith(_CUDA))
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            raise CheckpointError(
                f"{source}: saved with the RNG state of {len(cuda)} CUDA device(s), "
                f"this process has {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        for index, state in cuda:
            torch.cuda.set_rng_state(state, index)


def capture_rank_rngs() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every rank's `capture_rng`, on every rank (collective under torchrun; this process's alone otherwise):
    ({"world_size": N, "ranks": [plain of rank 0, ...]}, {"rank<r>.<name>": tensor of rank r})."""
    states = all_gather_objects(capture_rng())
    plain = {"world_size": len(states), "ranks": [rank_plain for rank_plain, _ in states]}
    tensors = {
        f"rank{rank}.{name}": t for rank, (_, rank_tensors) in enumerate(states) for name, t in rank_tensors.items()
    }
    return plain, tensors


def restore_rank_rng(
    plain: dict[str, Any], tensors: dict[str, torch.Tensor], source: str, rank: int, world_size: int
) -> None:
    """Put back this rank's part of what `capture_rank_rngs` returned (see the module docstring for a different
    world size). A checkpoint of the older format (one state, rank 0's) is restored on every rank."""
    if "ranks" not in plain:
        restore_rng(plain, tensors, source)
        return
    saved = int(plain["world_size"])
    if saved != world_size and rank == 0:
        logger.warning(
            "%s: RNG states of %d rank(s), this run has %d: ranks below %d continue their saved streams, "
            "the others keep the streams they were seeded with; random draws (unseeded rollouts, dropout) "
            "differ from the uninterrupted run's",
            source,
            saved,
            world_size,
            min(saved, world_size),
        )
    if rank >= saved:
        return
    prefix = f"rank{rank}."
    own = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
    restore_rng(plain["ranks"][rank], own, source)

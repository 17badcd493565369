"""Every random generator a training step may draw from, captured and restored for exact resume.

Python's `random`, NumPy's legacy global generator, torch's CPU generator and the generator of every
CUDA device. What a step draws from them (dropout, LoRA dropout, an epoch's reshuffle, the rollout
engine's unseeded samples) is then the same after a resume as in a run that never stopped.

The state comes in two parts so that nothing needs pickling: plain JSON (Python's and NumPy's
Mersenne-Twister words as int lists) and uint8 tensors (torch's states) for a safetensors file.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from posttrain.errors import CheckpointError

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
    cuda = sorted((int(k[len(_CUDA):]), v) for k, v in tensors.items() if k.startswith(_CUDA))
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            raise CheckpointError(f"{source}: saved with the RNG state of {len(cuda)} CUDA device(s), "
                                  f"this process has {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        for index, state in cuda:
            torch.cuda.set_rng_state(state, index)

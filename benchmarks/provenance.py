"""What every benchmark's JSON line names about the run: versions of each side's software, threads, the CPU.

    from provenance import environment
    result["environment"] = environment()          # torch / transformers / trl / peft versions, threads, CPU

A ratio is only as good as the description of its two sides: the same figure on another CPU, another torch or
another thread count is another measurement. Packages that are not installed are left out, not guessed.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "posttrain")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed distribution versions by name; a package that is not installed is absent."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def environment() -> dict[str, object]:
    """The run's software and hardware: versions, torch threads, CPU model and the flags that pick kernels."""
    import torch

    from posttrain.hardware import cpu_features, torch_capability

    features = cpu_features()
    return {
        "versions": package_versions(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": features.model,
        "cpu_flags": features.shown_flags(),
        "cpu_flags_forced": features.forced,
        "torch_capability": torch_capability(),
    }


def torch_dtype_name(dtype: object) -> str:
    """'float32' for torch.float32 (the names the JSON lines use on both sides)."""
    return str(dtype).removeprefix("torch.")

"""How much memory the engine's device has free: sizes the KV pool and decides whether weights get packed."""

from __future__ import annotations

import torch


def free_device_memory(device: torch.device) -> int:
    """Free bytes on a CUDA device, or MemAvailable of the host for CPU (4 GiB where /proc is missing)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30

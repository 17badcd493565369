"""Memory and time of a training step, estimated from the shapes alone (`posttrain estimate`)."""

from posttrain.estimate.compute import DEVICES, DeviceKind, TimeEstimate, device_kind, estimate_time
from posttrain.estimate.memory import (
    ALL_LINEARS,
    Architecture,
    MemoryEstimate,
    TrainingSetup,
    estimate_memory,
)

__all__ = [
    "ALL_LINEARS", "DEVICES", "Architecture", "DeviceKind", "MemoryEstimate", "TimeEstimate", "TrainingSetup",
    "device_kind", "estimate_memory", "estimate_time",
]

"""Memory and time of a training step, estimated from the shapes alone (`posttrain estimate`)."""

from posttrain.estimate.compute import DEVICES, DeviceKind, TimeEstimate, device_kind, estimate_time
from posttrain.estimate.inputs import ALL_LINEARS, Architecture, TrainingSetup
from posttrain.estimate.memory import MemoryEstimate, estimate_memory
from posttrain.estimate.trainer_rules import TRAINERS, TrainerRules

__all__ = [
    "ALL_LINEARS",
    "DEVICES",
    "TRAINERS",
    "Architecture",
    "DeviceKind",
    "MemoryEstimate",
    "TimeEstimate",
    "TrainerRules",
    "TrainingSetup",
    "device_kind",
    "estimate_memory",
    "estimate_time",
]

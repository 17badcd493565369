"""The old import path of the DPO trainer, kept so `from posttrain.trainers.dpo import DPOConfig, train_dpo`
keeps working: the trainer lives in `posttrain.trainers.preference.dpo`."""

from posttrain.trainers.preference.dpo import DPOConfig, train_dpo

__all__ = ["DPOConfig", "train_dpo"]

"""Algorithm math as pure tensor functions: advantages, KL estimators, policy / value / preference
losses, loss aggregation, off-policy (IS) correction, the RL objective that composes them, and memory-lean log-probabilities.
Imports nothing else of posttrain.

Each family has a registry mapping a config name to one function per variant.
"""

from posttrain.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    dapo_dynamic_sampling_mask,
    soft_overlong_penalty,
)
from posttrain.algos.aggregation import AGGREGATIONS
from posttrain.algos.importance import CORRECTIONS, OffPolicyParams, off_policy_weights
from posttrain.algos.kl import KL_ESTIMATORS
from posttrain.algos.logprobs import chunked_cross_entropy, entropy_from_logits, token_logprobs
from posttrain.algos.losses import POLICY_LOSSES, value_loss
from posttrain.algos.masked import masked_mean, masked_whiten
from posttrain.algos.objective import ObjectiveParams, rl_objective
from posttrain.algos.preference import PREFERENCE_LOSSES

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "ObjectiveParams",
    "OffPolicyParams",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "chunked_cross_entropy",
    "dapo_dynamic_sampling_mask",
    "entropy_from_logits",
    "masked_mean",
    "masked_whiten",
    "off_policy_weights",
    "rl_objective",
    "soft_overlong_penalty",
    "token_logprobs",
    "value_loss",
]

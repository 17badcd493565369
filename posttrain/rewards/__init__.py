"""Reward functions for RL: built-ins, your own from a file, a reward model; combined per batch.

A reward function is called once per batch as `fn(prompts=..., completions=..., **columns)` and returns
one float per sample, or None where it cannot score one (see `base` and docs/rewards.md).
Rewards never import a trainer: they see prompts, completions and dataset columns only.
"""

from posttrain.rewards.answers import boxed, gsm8k, last_boxed, last_number, numeric_match
from posttrain.rewards.base import RewardError, RewardFn, completion_text
from posttrain.rewards.combine import RewardResult, RewardSpec, compute_rewards
from posttrain.rewards.format import THINK_ANSWER_PATTERN, format_reward
from posttrain.rewards.length import COMPLETION_IDS_COLUMN, length_penalty, overlong_penalty
from posttrain.rewards.loading import BUILTINS, load_reward, load_reward_specs
from posttrain.rewards.model_reward import RewardModelScorer, load_score_head, save_score_head
from posttrain.rewards.signature import check_reward_signature

__all__ = [
    "BUILTINS",
    "COMPLETION_IDS_COLUMN",
    "THINK_ANSWER_PATTERN",
    "RewardError",
    "RewardFn",
    "RewardModelScorer",
    "RewardResult",
    "RewardSpec",
    "boxed",
    "check_reward_signature",
    "completion_text",
    "compute_rewards",
    "format_reward",
    "gsm8k",
    "last_boxed",
    "last_number",
    "length_penalty",
    "load_reward",
    "load_reward_specs",
    "load_score_head",
    "numeric_match",
    "overlong_penalty",
    "save_score_head",
]

"""Typed configs of the RL trainers (`posttrain grpo`, `posttrain ppo`) and the algorithm presets.

`GRPOConfig.algorithm` names an entry of `ALGORITHMS`: a preset that sets the advantage estimator,
the policy loss, the aggregation, the clip range and the DAPO switches. Any of those can be
overridden in the `loss:` / `dapo:` sections; a `None` there means "the preset's value".
`PPOConfig` has the same sections plus `ppo:` (value head, GAE, value clipping).

The sections (rl/sections.py) check themselves in `validate()`; `validate_config` runs the cross-section checks
(group size divides the batch, minibatch divides the batch, ...), so a bad config fails before
any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.algos.objective import ObjectiveParams
from posttrain.config import run_validators
from posttrain.distributed.config import DistSection
from posttrain.peft import LoraConfig
from posttrain.trainers.adapters import check_adapter_options
from posttrain.trainers.rl.env_section import EnvSection
from posttrain.trainers.rl.sections import (
    DAPOSection,
    DataSection,
    EvalSection,
    KLSection,
    LossSection,
    PPOSection,
    RewardSection,
    RLLogSection,
    RLTrainSection,
    RolloutSection,
    need,
    rl_optim,
)
from posttrain.trainers.sections import ModelSection, OptimSection

# ----------------------------------------------------------------------------- algorithm presets


@dataclass(frozen=True)
class AlgorithmPreset:
    """What one algorithm name means: its advantage estimator, policy loss and loss aggregation."""

    advantage: str  # ADVANTAGE_ESTIMATORS key
    policy_loss: str  # POLICY_LOSSES key
    aggregation: str  # AGGREGATIONS key
    clip_eps_low: float
    clip_eps_high: float
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill the batch
    overlong_penalty: bool = False  # DAPO: soft penalty for responses near max_tokens


ALGORITHMS: dict[str, AlgorithmPreset] = {
    # DeepSeekMath GRPO: group-normalised outcome advantage, PPO clip, per-sequence token mean.
    "grpo": AlgorithmPreset("grpo", "ppo_clip", "seq-mean-token-mean", 0.2, 0.2),
    # Dr.GRPO: no std scaling, constant normaliser (B * max_tokens).
    "dr_grpo": AlgorithmPreset("dr_grpo", "ppo_clip", "seq-mean-token-sum-norm", 0.2, 0.2),
    # DAPO: clip-higher, token-mean, dynamic sampling, soft overlong penalty.
    "dapo": AlgorithmPreset("grpo", "dapo", "token-mean", 0.2, 0.28, dynamic_sampling=True, overlong_penalty=True),
    # GSPO: sequence-level (geometric mean) ratio with its tiny clip range.
    "gspo": AlgorithmPreset("grpo", "gspo", "seq-mean-token-mean", 3e-4, 4e-4),
    # RLOO: leave-one-out baseline.
    "rloo": AlgorithmPreset("rloo", "ppo_clip", "seq-mean-token-mean", 0.2, 0.2),
    # REINFORCE++: token returns (KL-shaped when kl.in_reward), batch whitening, token-mean.
    "reinforce_pp": AlgorithmPreset("reinforce_pp", "ppo_clip", "token-mean", 0.2, 0.2),
}

# PPO is not a GRPOConfig algorithm: it needs the value head and GAE of `PPOConfig.ppo`.
PPO_PRESET = AlgorithmPreset("gae", "ppo_clip", "token-mean", 0.2, 0.2)

# ----------------------------------------------------------------------------- the two configs


@dataclass
class GRPOConfig:
    """`posttrain grpo`: the GRPO family on the shared-weight engine."""

    algorithm: str = "grpo"  # ALGORITHMS key
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: RLTrainSection = field(default_factory=RLTrainSection)
    optim: OptimSection = field(default_factory=rl_optim)
    loss: LossSection = field(default_factory=LossSection)
    kl: KLSection = field(default_factory=KLSection)
    dapo: DAPOSection = field(default_factory=DAPOSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: RLLogSection = field(default_factory=RLLogSection)
    lora: LoraConfig | None = None  # train LoRA adapters; the KL reference is then the base (adapters off)
    quant: str | None = None  # QLoRA: quantize the frozen base (int8, int4-g64, ...) under the adapters; needs lora
    out: str | None = None  # run directory; None: runs/grpo-<timestamp>
    resume: str | None = None  # auto (the newest checkpoint in out) or a checkpoint directory; see docs/resume.md
    save_final: bool = True
    dist: DistSection = field(default_factory=DistSection)  # torchrun data parallelism; see docs/distributed.md
    env: EnvSection | None = None  # multi-turn episodes with an environment and tools; see docs/agents.md

    def validate(self) -> None:
        need(
            self.algorithm in ALGORITHMS,
            f"algorithm {self.algorithm!r} is not one of {', '.join(ALGORITHMS)} (PPO is `posttrain ppo`)",
        )
        validate_config(self)


@dataclass
class PPOConfig:
    """`posttrain ppo`: PPO with GAE and a value head on the policy trunk."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=lambda: RolloutSection(prompts_per_step=32, samples_per_prompt=2))
    train: RLTrainSection = field(default_factory=lambda: RLTrainSection(epochs=2, minibatch_size=32))
    optim: OptimSection = field(default_factory=rl_optim)
    loss: LossSection = field(default_factory=LossSection)
    kl: KLSection = field(default_factory=lambda: KLSection(beta=0.0, estimator="k1", in_reward=True))
    dapo: DAPOSection = field(default_factory=DAPOSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: RLLogSection = field(default_factory=RLLogSection)
    lora: LoraConfig | None = None
    quant: str | None = None  # QLoRA, as in GRPOConfig
    out: str | None = None
    resume: str | None = None  # as in GRPOConfig
    save_final: bool = True
    dist: DistSection = field(default_factory=DistSection)  # torchrun data parallelism; docs/distributed.md
    env: EnvSection | None = None  # multi-turn episodes, as in GRPOConfig; GAE runs over the model's tokens

    def validate(self) -> None:
        need(self.loss.advantage in (None, "gae"), "PPO's advantage is GAE; leave loss.advantage unset")
        need(self.loss.policy_loss in (None, "ppo_clip", "dapo"), "PPO's policy loss is ppo_clip or dapo")
        validate_config(self)


RLConfig = GRPOConfig | PPOConfig


# ----------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """The preset with the config's overrides applied: everything the loop reads about the algorithm."""

    name: str
    advantage: str
    policy_loss: str
    aggregation: str
    loss_kwargs: dict[str, Any]
    dynamic_sampling: bool
    overlong_penalty: bool
    uses_value_head: bool

    @property
    def token_level_advantage(self) -> bool:
        return self.advantage in ("reinforce_pp", "gae")


def resolve_algorithm(cfg: RLConfig) -> ResolvedAlgorithm:
    is_ppo = isinstance(cfg, PPOConfig)
    preset = PPO_PRESET if is_ppo else ALGORITHMS[cfg.algorithm]
    loss = cfg.loss
    policy_loss = loss.policy_loss or preset.policy_loss
    low = loss.clip_eps_low if loss.clip_eps_low is not None else preset.clip_eps_low
    high = loss.clip_eps_high if loss.clip_eps_high is not None else preset.clip_eps_high
    if policy_loss in ("ppo_clip", "grpo"):
        if loss.clip_eps_high is None and loss.clip_eps_low is not None:
            high = low  # one symmetric range unless both are given
        if low != high:
            raise ValueError(
                f"policy loss {policy_loss!r} clips symmetrically; use loss.policy_loss=dapo for "
                f"clip_eps_low={low} != clip_eps_high={high}"
            )
        kwargs: dict[str, Any] = {"clip_eps": low, "dual_clip": loss.dual_clip}
    elif policy_loss == "dapo":
        kwargs = {"clip_eps_low": low, "clip_eps_high": high, "dual_clip": loss.dual_clip}
    else:  # gspo
        if loss.dual_clip is not None:
            raise ValueError("loss.dual_clip is not defined for the gspo policy loss")
        kwargs = {"clip_eps_low": low, "clip_eps_high": high}
    dapo = cfg.dapo
    return ResolvedAlgorithm(
        name="ppo" if is_ppo else cfg.algorithm,
        advantage=loss.advantage or preset.advantage,
        policy_loss=policy_loss,
        aggregation=loss.aggregation or preset.aggregation,
        loss_kwargs=kwargs,
        dynamic_sampling=preset.dynamic_sampling if dapo.dynamic_sampling is None else dapo.dynamic_sampling,
        overlong_penalty=preset.overlong_penalty if dapo.overlong_penalty is None else dapo.overlong_penalty,
        uses_value_head=is_ppo,
    )


def objective_params(cfg: RLConfig, algo: ResolvedAlgorithm, rollout_mismatch: bool = False) -> ObjectiveParams:
    """The update's loss hyperparameters, read from the config once: the KL is a loss term unless it
    shapes the reward (kl.in_reward), where the update only measures it. `rollout_mismatch`: the engine computes
    in another dtype than the update (train.off_policy.mode auto then corrects for it)."""
    value = {"value_clip": cfg.ppo.value_clip} if isinstance(cfg, PPOConfig) else {}
    return ObjectiveParams(
        policy_loss=algo.policy_loss,
        aggregation=algo.aggregation,
        max_len=completion_budget(cfg),
        loss_params=algo.loss_kwargs,
        off_policy=cfg.train.off_policy_params(rollout_mismatch, stale=may_be_stale(cfg)),
        kl_estimator=cfg.kl.estimator,
        kl_coef=0.0 if cfg.kl.in_reward else cfg.kl.beta,
        entropy_coef=cfg.loss.entropy_coef,
        **value,
    )


def may_be_stale(cfg: RLConfig) -> bool:
    """Whether the update may train on samples drawn under older weights (async with max_staleness >= 1)."""
    return cfg.rollout.mode == "async" and cfg.rollout.max_staleness > 0


def completion_budget(cfg: RLConfig) -> int:
    """The most tokens a sample has after its prompt: rollout.max_tokens, or an episode's env.max_episode_tokens."""
    env = getattr(cfg, "env", None)
    return env.max_episode_tokens if env is not None else cfg.rollout.max_tokens


def batch_sizes(cfg: RLConfig) -> tuple[int, int, int]:
    """(rollout batch, minibatch, micro-batch) in samples."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    minibatch = cfg.train.minibatch_size or batch
    micro = cfg.train.micro_batch_size or minibatch
    return batch, minibatch, micro


def rank_batch_sizes(cfg: RLConfig, world: int) -> tuple[int, int, int]:
    """(rollout batch, minibatch, micro-batch) in samples on one of `world` data-parallel ranks: each takes
    1/world of the batch and of every minibatch; an unset micro_batch_size is then the rank's minibatch.
    ValueError naming the key when the sizes do not divide into whole groups per rank."""
    batch, minibatch, micro = batch_sizes(cfg)
    group = cfg.rollout.samples_per_prompt
    need(
        cfg.rollout.prompts_per_step % world == 0,
        f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must divide evenly over the {world} processes "
        "(a prompt's group stays on one rank)",
    )
    need(
        minibatch % (world * group) == 0,
        f"train.minibatch_size={minibatch} must be whole groups of {group} samples on each of the {world} processes",
    )
    local_minibatch = minibatch // world
    local_micro = micro if cfg.train.micro_batch_size is not None else local_minibatch
    need(
        local_minibatch % local_micro == 0,
        f"train.micro_batch_size={local_micro} must divide each process's share of train.minibatch_size "
        f"({minibatch} / {world} processes = {local_minibatch})",
    )
    return batch // world, local_minibatch, local_micro


def validate_config(cfg: RLConfig) -> None:
    """Cross-section checks; raises ValueError naming the keys (the loader adds the file)."""
    check_adapter_options(cfg.lora, cfg.quant)
    group = cfg.rollout.samples_per_prompt
    batch, minibatch, micro = batch_sizes(cfg)
    need(
        minibatch % group == 0,
        f"train.minibatch_size={minibatch} is not a whole number of groups of rollout.samples_per_prompt={group} "
        "(a group's samples share one packed prompt)",
    )
    need(
        batch % minibatch == 0,
        f"train.minibatch_size={minibatch} does not divide the rollout batch of "
        f"{cfg.rollout.prompts_per_step} prompts x {group} samples = {batch}",
    )
    need(
        micro % group == 0,
        f"train.micro_batch_size={micro} is not a whole number of groups of rollout.samples_per_prompt={group}",
    )
    need(minibatch % micro == 0, f"train.micro_batch_size={micro} does not divide train.minibatch_size={minibatch}")
    need(
        not (cfg.dist.rollout_weights == "per_layer" and cfg.rollout.engine.cuda_graphs),
        "dist.rollout_weights=per_layer all-gathers each layer inside every engine forward, which a captured CUDA "
        "graph cannot replay: set rollout.engine.cuda_graphs=false (or dist.rollout_weights=whole)",
    )
    need(
        not (cfg.rollout.mode == "async" and cfg.lora is not None and cfg.lora.dropout > 0),
        f"rollout.mode=async with lora.dropout={cfg.lora.dropout if cfg.lora else 0}: the rollout thread's forwards "
        "run while the update holds the module in training mode, where LoRA dropout is on; set lora.dropout=0",
    )
    need(
        not (cfg.train.off_policy.mode == "decoupled" and cfg.train.old_logprobs == "rollout"),
        "train.off_policy.mode=decoupled needs pi_old recomputed by the trainer (the proximal policy): "
        "train.old_logprobs must be auto or recompute, not rollout",
    )
    algo = resolve_algorithm(cfg)
    if algo.advantage in ("grpo", "dr_grpo", "rloo"):
        need(group >= 2, f"rollout.samples_per_prompt={group}: a group baseline ({algo.advantage}) needs >= 2 samples")
    if algo.dynamic_sampling:
        need(group >= 2, "dapo.dynamic_sampling needs rollout.samples_per_prompt >= 2")
    env = getattr(cfg, "env", None)
    if env is not None and env.turn_rewards == "per_turn":
        need(
            algo.token_level_advantage,
            f"env.turn_rewards=per_turn places each turn's reward on its last token, which only a token-level "
            f"advantage uses (posttrain ppo, algorithm reinforce_pp); {algo.advantage!r} scores whole episodes: "
            "use env.turn_rewards=sum",
        )
    if algo.overlong_penalty:
        need(
            cfg.dapo.overlong_cache_len <= cfg.rollout.max_tokens,
            f"dapo.overlong_cache_len={cfg.dapo.overlong_cache_len} exceeds rollout.max_tokens={cfg.rollout.max_tokens}",
        )


def validate_tree(cfg: Any) -> None:
    """Run every section's `validate()` (children first), as `load_config` does, for configs built in Python."""
    run_validators(cfg, lambda _key, section: type(section).__name__)

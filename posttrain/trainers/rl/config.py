"""Typed configs of the RL trainers (`posttrain grpo`, `posttrain ppo`) and the algorithm presets.

`GRPOConfig.algorithm` names an entry of `ALGORITHMS`: a preset that sets the advantage estimator,
the policy loss, the aggregation, the clip range and the DAPO switches. Any of those can be
overridden in the `loss:` / `dapo:` sections; a `None` there means "the preset's value".
`PPOConfig` has the same sections plus `ppo:` (value head, GAE, value clipping).

Every section checks itself in `validate()`; `validate_config` runs the cross-section checks
(group size divides the batch, minibatch divides the batch, ...), so a bad config fails before
any model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.algos import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from posttrain.algos.importance import OffPolicyParams
from posttrain.algos.objective import ObjectiveParams
from posttrain.config import run_validators
from posttrain.distributed.config import DistSection
from posttrain.engine.config import EngineConfig
from posttrain.peft import LoraConfig
from posttrain.trainers.adapters import check_adapter_options
from posttrain.trainers.rl.env_section import EnvSection
from posttrain.trainers.sections import LogSection, ModelSection, OptimSection

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

# ----------------------------------------------------------------------------- sections


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive(name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _need(value is not None and math.isfinite(value) and value > 0, f"{name} must be > 0, got {value!r}")


@dataclass
class DataSection:
    """Where prompts come from: a built-in task, or a dataset (JSONL, Parquet, a saved HF dataset) with a prompt column."""

    task: str | None = "arithmetic"  # posttrain.tasks.TASKS key; null: read the dataset at `path`
    path: str | None = None  # with a task: the task's data file (gsm8k); without: a dataset file or directory
    prompt_column: str = "prompt"  # a string, or a list of chat messages
    prompt_template: str | None = None  # e.g. "{question}\nEnd with: #### <number>" (row columns by name)
    system_prompt: str | None = None  # prepended as a system message to string prompts
    seed: int = 0
    eval_size: int = 100  # held-out prompts scored greedily before and after training (0: none)

    def validate(self) -> None:
        _need(
            self.task is not None or self.path is not None,
            "set data.task (a built-in task) or data.path (a dataset), or both (the task's data file)",
        )
        _need(self.eval_size >= 0, f"eval_size must be >= 0, got {self.eval_size}")


@dataclass
class RewardSection:
    # `load_reward` specs: a built-in name or "path/file.py:function". Empty: the task's default reward.
    functions: list[str] = field(default_factory=list)
    weights: list[float] | None = None  # one per function; None: all 1
    correct_threshold: float = 1.0  # a held-out answer counts as correct when its total reward >= this

    def validate(self) -> None:
        if self.weights is not None:
            _need(
                len(self.weights) == len(self.functions),
                f"weights has {len(self.weights)} entries for {len(self.functions)} functions",
            )


@dataclass
class RolloutSection:
    prompts_per_step: int = 8
    samples_per_prompt: int = 8  # the group size
    max_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 128  # longer prompts are refused by the engine; sizes its KV cache
    # Seed each prompt's request from (train.seed, step, its place among the step's prompts): a prompt's
    # samples then depend on nothing else, so a data-parallel run samples what a single process would.
    # false: the requests draw from torch's generator (restored on resume; seeded train.seed + rank).
    seed_prompts: bool = False
    # sync: generate, score, update, one after the other. async: the rollout of the next step(s) runs in its own
    # thread while the update runs (docs/rl.md "Asynchronous rollouts"); prompts are then always seeded as with
    # seed_prompts, so a step's samples do not depend on thread timing.
    mode: Literal["sync", "async"] = "sync"
    # async: a sample is used at policy version v only if every token it sampled was drawn at a version >= v - k
    # (a version is one optimizer step). 0: on-policy (the same samples as sync). The rollout runs
    # max_staleness // (optimizer steps per RL step) steps ahead of the update.
    max_staleness: int = 1
    # async: torch's intra-op threads each side runs while both are busy (a side that waits lends the other all of
    # them); null: half of torch's threads at the start (at least 1), so the two sides together fill the cores.
    async_threads: int | None = None
    # async: what sequences still being generated do when the weights change under them. keep: go on over the K/V
    # they have (PipelineRL's in-flight update; the next tokens are drawn by the new weights and record the new
    # version). recompute: re-prefill everything they hold under the new weights first (exact K/V, more compute).
    running_kv: Literal["keep", "recompute"] = "keep"
    async_timeout_s: float = 600.0  # async: the trainer stops with an error when no batch comes within this
    # async, single-turn, without dynamic sampling: once at most this share of a step's samples are still generating
    # and the bound lets the rollout start the next step (k >= optimizer steps per RL step), the next step's prompts
    # join the same engine batch (its tail would otherwise decode at a tiny batch). 1: at once; 0: off, the default
    # until it measures faster (on 2 cores it did not: docs/rl.md).
    async_fill: float = 0.0
    # The engine over the live policy. max_model_len and max_num_seqs left at their defaults are set
    # from max_prompt_tokens + max_tokens and max(batch, data.eval_size) (a KV pool that fits, no more).
    engine: EngineConfig = field(default_factory=EngineConfig)

    def validate(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_tokens", "max_prompt_tokens"):
            _need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _positive("temperature", self.temperature)  # 0 would make the logprobs of sampling meaningless
        _need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _need(self.mode in ("sync", "async"), f"mode must be sync or async, got {self.mode!r}")
        _need(
            isinstance(self.max_staleness, int)
            and not isinstance(self.max_staleness, bool)
            and self.max_staleness >= 0,
            f"max_staleness must be an integer >= 0 (policy versions), got {self.max_staleness!r}",
        )
        _need(
            self.async_threads is None or self.async_threads >= 1,
            f"async_threads must be >= 1 or null, got {self.async_threads}",
        )
        _positive("async_timeout_s", self.async_timeout_s)
        _need(
            isinstance(self.async_fill, (int, float))
            and not isinstance(self.async_fill, bool)
            and 0 <= self.async_fill <= 1,
            f"async_fill must be a number in [0, 1] (0: off), got {self.async_fill!r}",
        )
        _need(
            self.running_kv in ("keep", "recompute"),
            f"running_kv must be keep or recompute, got {self.running_kv!r}",
        )


@dataclass
class OffPolicySection:
    """`train.off_policy`: importance-sampling correction of pi_old against the engine's logprobs (the behaviour
    policy), posttrain.algos.importance. ratio = pi_old / pi_engine, per token or per sequence (the product)."""

    # auto: none while the engine computes in the update's dtype and samples are on-policy; tis per token (cap) when
    # they differ (a bf16 update over an fp32 engine on a fast-bf16 CPU, say) or when rollout.mode=async with
    # max_staleness >= 1 (stale samples). tis: weight min(ratio, cap). mis: tokens (or whole sequences) whose ratio
    # is outside [low, high] leave the loss. decoupled: AReaL's decoupled PPO (the clip around pi_old, recomputed
    # by the trainer as the proximal policy; the ratio as a weight, tokens with ratio > cap dropped; per token).
    # none: off.
    mode: Literal["auto", "none", "tis", "mis", "decoupled"] = "auto"
    level: Literal["token", "sequence"] = "token"
    cap: float = 2.0  # tis
    low: float | None = None  # mis; null: 1 / high
    high: float = 2.0  # mis

    def validate(self) -> None:
        modes = ("auto", "none", "tis", "mis", "decoupled")
        _need(self.mode in modes, f"mode must be one of {', '.join(modes)}, got {self.mode!r}")
        _need(
            self.mode != "decoupled" or self.level == "token",
            "mode decoupled weighs each token (AReaL's behaviour weight): level must be token",
        )
        self.params("tis")  # the bounds, checked whatever the mode

    def params(self, mode: str) -> OffPolicyParams:
        return OffPolicyParams(mode, self.level, cap=self.cap, low=self.low, high=self.high)


@dataclass
class RLTrainSection:
    """`train:` of grpo / ppo. Its `epochs` are PPO epochs: updates over each step's rollout batch (the batch
    is sampled fresh every step), not passes over the prompt data as the offline trainers' `epochs` are
    (sections.TrainSection)."""

    max_steps: int = 1000
    # Wall-clock budget of the whole run (load, evals and save included): a step starts only if it, the
    # final evaluation and the save still fit. None: no budget.
    max_minutes: float | None = 27.0
    epochs: int = 1  # PPO epochs: passes of the update over each step's rollout batch
    minibatch_size: int | None = None  # samples per optimizer step; None: the whole rollout batch
    micro_batch_size: int | None = None  # samples per forward/backward; None: the minibatch
    # Logprobs of the policy that sampled (pi_old) for the ratio:
    #   auto      - a single update per rollout: the current logprobs, detached (ratio == 1, no extra pass);
    #               several updates: recompute before the first update (an extra no-grad pass)
    #   recompute - always the extra no-grad pass
    #   rollout   - the engine's sampling logprobs (same weights, paged kernel; no extra pass)
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"
    # Leave groups whose advantages are all zero out of the update's forward/backward when their gradient
    # is exactly zero (outcome advantages; no KL loss, entropy bonus, value or router loss). The gradient
    # is unchanged; entropy / clip / mismatch metrics then cover the samples that train.
    skip_zero_advantage: bool = True
    # Off-policy correction against the engine's logprobs (see OffPolicySection).
    off_policy: OffPolicySection = field(default_factory=OffPolicySection)
    # The older switch, kept as an alias: tis_cap C is off_policy {mode: tis, level: token, cap: C}. None: unset.
    tis_cap: float | None = None
    seed: int = 0
    save_every: int = 0  # steps between checkpoints/step-N (resumable with resume=auto); 0: only the final model
    keep_checkpoints: int | None = None  # keep the newest N step checkpoints; null: keep all
    # An optimizer update with a non-finite loss or gradient norm is skipped (weights untouched); this
    # many in a row end the run with an error naming the step.
    max_bad_steps: int = 5

    def validate(self) -> None:
        _need(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        _need(self.save_every >= 0, f"save_every must be >= 0, got {self.save_every}")
        _need(
            self.keep_checkpoints is None or self.keep_checkpoints >= 1,
            f"keep_checkpoints must be >= 1 or null, got {self.keep_checkpoints}",
        )
        _need(self.max_bad_steps >= 1, f"max_bad_steps must be >= 1, got {self.max_bad_steps}")
        _positive("max_minutes", self.max_minutes, allow_none=True)
        _need(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        for name in ("minibatch_size", "micro_batch_size"):
            value = getattr(self, name)
            _need(value is None or value >= 1, f"{name} must be >= 1, got {value}")
        _need(self.tis_cap is None or self.tis_cap >= 1, f"tis_cap must be >= 1, got {self.tis_cap}")
        _need(
            self.tis_cap is None or self.off_policy == OffPolicySection(),
            "set train.tis_cap or train.off_policy, not both (tis_cap C is off_policy {mode: tis, cap: C})",
        )

    def off_policy_params(self, rollout_mismatch: bool, stale: bool = False) -> OffPolicyParams | None:
        """The correction the update applies; `rollout_mismatch`: the engine computes in another dtype than the
        update; `stale`: samples may be older than the update's weights (async, max_staleness >= 1). Mode auto
        turns token-level TIS on for either."""
        section = self.off_policy
        if self.tis_cap is not None:
            return OffPolicyParams("tis", "token", cap=self.tis_cap)
        if section.mode == "auto":
            return section.params("tis") if rollout_mismatch or stale else None
        return None if section.mode == "none" else section.params(section.mode)


def _rl_optim() -> OptimSection:
    """RL's optimizer defaults: a constant LR (a fresh batch every step, no epoch to anneal over)."""
    return OptimSection(lr=3e-5, betas=(0.9, 0.99), schedule="constant")


@dataclass
class LossSection:
    """Overrides of the algorithm preset (None: the preset's value) and the entropy bonus."""

    advantage: str | None = None
    policy_loss: str | None = None
    aggregation: str | None = None
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip: float | None = None  # dual-clip PPO constant c > 1 (ppo_clip / dapo only)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy (same aggregation)

    def validate(self) -> None:
        for name, registry in (
            ("advantage", ADVANTAGE_ESTIMATORS),
            ("policy_loss", POLICY_LOSSES),
            ("aggregation", AGGREGATIONS),
        ):
            value = getattr(self, name)
            _need(value is None or value in registry, f"{name} {value!r} is not one of {', '.join(registry)}")
        _need(self.advantage != "gae", "advantage 'gae' needs a value head: use `posttrain ppo`")
        for name in ("clip_eps_low", "clip_eps_high"):
            _positive(name, getattr(self, name), allow_none=True)
        _need(self.dual_clip is None or self.dual_clip > 1, f"dual_clip must be > 1, got {self.dual_clip}")
        _need(self.entropy_coef >= 0, f"entropy_coef must be >= 0, got {self.entropy_coef}")


@dataclass
class KLSection:
    beta: float = 0.0  # 0: no reference model at all
    estimator: str = "k3"  # KL_ESTIMATORS key
    in_reward: bool = False  # fold -beta * KL into the reward instead of adding a loss term

    def validate(self) -> None:
        _need(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        _need(self.estimator in KL_ESTIMATORS, f"estimator {self.estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


@dataclass
class DAPOSection:
    """DAPO's sampling tricks; None takes the algorithm preset's switch (on for `dapo`)."""

    dynamic_sampling: bool | None = None
    max_refill_rounds: int = 3  # extra rollouts to refill a batch thinned by zero-variance groups
    overlong_penalty: bool | None = None
    overlong_cache_len: int = 8  # penalty ramps from max_tokens - cache_len to max_tokens
    overlong_penalty_factor: float = 1.0

    def validate(self) -> None:
        _need(self.max_refill_rounds >= 0, f"max_refill_rounds must be >= 0, got {self.max_refill_rounds}")
        _need(self.overlong_cache_len >= 1, f"overlong_cache_len must be >= 1, got {self.overlong_cache_len}")
        _need(self.overlong_penalty_factor >= 0, "overlong_penalty_factor must be >= 0")


@dataclass
class PPOSection:
    """PPO's critic: a value head (Linear(d, 1)) on the policy's own final hidden states."""

    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.5  # loss += vf_coef * value loss
    value_clip: float = 0.2
    whiten_advantages: bool = True
    value_lr: float | None = None  # the value head's learning rate; None: optim.lr * 100 (a fresh head)

    def validate(self) -> None:
        _need(0 <= self.gamma <= 1, f"gamma must be in [0, 1], got {self.gamma}")
        _need(0 <= self.lam <= 1, f"lam must be in [0, 1], got {self.lam}")
        _need(self.vf_coef >= 0, f"vf_coef must be >= 0, got {self.vf_coef}")
        _positive("value_clip", self.value_clip)
        _positive("value_lr", self.value_lr, allow_none=True)


@dataclass
class EvalSection:
    every: int = 0  # also evaluate every N steps (0: only before and after)
    before: bool = True  # evaluate before the first step
    max_tokens: int | None = None  # None: rollout.max_tokens

    def validate(self) -> None:
        _need(self.every >= 0, f"every must be >= 0, got {self.every}")


@dataclass
class RLLogSection(LogSection):
    """The shared `log` section (report_to, project, tensorboard) and the RL loop's progress bar switch."""

    progress: bool = True  # a tqdm bar with the step's headline metrics, against the bound that ends the run


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
    optim: OptimSection = field(default_factory=_rl_optim)
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
        _need(
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
    optim: OptimSection = field(default_factory=_rl_optim)
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
        _need(self.loss.advantage in (None, "gae"), "PPO's advantage is GAE; leave loss.advantage unset")
        _need(self.loss.policy_loss in (None, "ppo_clip", "dapo"), "PPO's policy loss is ppo_clip or dapo")
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
    _need(
        cfg.rollout.prompts_per_step % world == 0,
        f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must divide evenly over the {world} processes "
        "(a prompt's group stays on one rank)",
    )
    _need(
        minibatch % (world * group) == 0,
        f"train.minibatch_size={minibatch} must be whole groups of {group} samples on each of the {world} processes",
    )
    local_minibatch = minibatch // world
    local_micro = micro if cfg.train.micro_batch_size is not None else local_minibatch
    _need(
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
    _need(
        minibatch % group == 0,
        f"train.minibatch_size={minibatch} is not a whole number of groups of rollout.samples_per_prompt={group} "
        "(a group's samples share one packed prompt)",
    )
    _need(
        batch % minibatch == 0,
        f"train.minibatch_size={minibatch} does not divide the rollout batch of "
        f"{cfg.rollout.prompts_per_step} prompts x {group} samples = {batch}",
    )
    _need(
        micro % group == 0,
        f"train.micro_batch_size={micro} is not a whole number of groups of rollout.samples_per_prompt={group}",
    )
    _need(minibatch % micro == 0, f"train.micro_batch_size={micro} does not divide train.minibatch_size={minibatch}")
    _need(
        not (cfg.dist.rollout_weights == "per_layer" and cfg.rollout.engine.cuda_graphs),
        "dist.rollout_weights=per_layer all-gathers each layer inside every engine forward, which a captured CUDA "
        "graph cannot replay: set rollout.engine.cuda_graphs=false (or dist.rollout_weights=whole)",
    )
    _need(
        not (cfg.rollout.mode == "async" and cfg.lora is not None and cfg.lora.dropout > 0),
        f"rollout.mode=async with lora.dropout={cfg.lora.dropout if cfg.lora else 0}: the rollout thread's forwards "
        "run while the update holds the module in training mode, where LoRA dropout is on; set lora.dropout=0",
    )
    _need(
        not (cfg.train.off_policy.mode == "decoupled" and cfg.train.old_logprobs == "rollout"),
        "train.off_policy.mode=decoupled needs pi_old recomputed by the trainer (the proximal policy): "
        "train.old_logprobs must be auto or recompute, not rollout",
    )
    algo = resolve_algorithm(cfg)
    if algo.advantage in ("grpo", "dr_grpo", "rloo"):
        _need(group >= 2, f"rollout.samples_per_prompt={group}: a group baseline ({algo.advantage}) needs >= 2 samples")
    if algo.dynamic_sampling:
        _need(group >= 2, "dapo.dynamic_sampling needs rollout.samples_per_prompt >= 2")
    env = getattr(cfg, "env", None)
    if env is not None and env.turn_rewards == "per_turn":
        _need(
            algo.token_level_advantage,
            f"env.turn_rewards=per_turn places each turn's reward on its last token, which only a token-level "
            f"advantage uses (posttrain ppo, algorithm reinforce_pp); {algo.advantage!r} scores whole episodes: "
            "use env.turn_rewards=sum",
        )
    if algo.overlong_penalty:
        _need(
            cfg.dapo.overlong_cache_len <= cfg.rollout.max_tokens,
            f"dapo.overlong_cache_len={cfg.dapo.overlong_cache_len} exceeds rollout.max_tokens={cfg.rollout.max_tokens}",
        )


def validate_tree(cfg: Any) -> None:
    """Run every section's `validate()` (children first), as `load_config` does, for configs built in Python."""
    run_validators(cfg, lambda _key, section: type(section).__name__)

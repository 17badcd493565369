"""The sections of the RL trainers' configs (`data:`, `reward:`, `rollout:`, `train:`, `loss:`, `kl:`, `dapo:`,
`ppo:`, `eval:`, `log:`): each one's keys, defaults and `validate()`. The two configs that hold them, the algorithm
presets and the cross-section checks are in rl/config.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.algos import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from posttrain.algos.importance import OffPolicyParams
from posttrain.engine.config import EngineConfig
from posttrain.trainers.sections import LogSection, OptimSection


def need(ok: bool, message: str) -> None:
    """A config check: ValueError(message) unless ok (the config loader names the key and the file)."""
    if not ok:
        raise ValueError(message)


def positive(name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    need(value is not None and math.isfinite(value) and value > 0, f"{name} must be > 0, got {value!r}")


@dataclass
class DataSection:
    """Where prompts come from: a built-in task, or a dataset (JSONL, Parquet, a saved HF dataset) with a prompt column."""

    task: str | None = "arithmetic"  # posttrain.tasks.TASKS key; null: read the dataset at `path`
    # the task's own options beside its seed (e.g. word_problems' operation_weights); a task rejects unknown ones
    task_options: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # with a task: the task's data file (gsm8k); without: a dataset file or directory
    prompt_column: str = "prompt"  # a string, or a list of chat messages
    prompt_template: str | None = None  # e.g. "{question}\nEnd with: #### <number>" (row columns by name)
    system_prompt: str | None = None  # prepended as a system message to string prompts
    seed: int = 0
    eval_size: int = 100  # held-out prompts scored greedily before and after training (0: none)

    def validate(self) -> None:
        need(
            self.task is not None or self.path is not None,
            "set data.task (a built-in task) or data.path (a dataset), or both (the task's data file)",
        )
        need(self.eval_size >= 0, f"eval_size must be >= 0, got {self.eval_size}")
        need(not self.task_options or self.task is not None, "task_options needs data.task (a built-in task)")
        reserved = sorted({"seed", "path", "held_out_size"} & set(self.task_options))
        need(not reserved, f"task_options: {', '.join(reserved)} come from data.seed / data.path / data.eval_size")


@dataclass
class RewardSection:
    # `load_reward` specs: a built-in name or "path/file.py:function". Empty: the task's default reward.
    functions: list[str] = field(default_factory=list)
    weights: list[float] | None = None  # one per function; None: all 1
    correct_threshold: float = 1.0  # a held-out answer counts as correct when its total reward >= this

    def validate(self) -> None:
        if self.weights is not None:
            need(
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
    # async, without dynamic sampling: once at most this share of a step's samples are still generating (episodes:
    # have a turn generating, the rest wait on tools or ended) and the bound lets the rollout start the next step
    # (k >= optimizer steps per RL step), the next step's prompts join the same engine batch (single-turn: its tail
    # would otherwise decode at a tiny batch; episodes: they decode while this step's wait on their tools).
    # 1: at once; 0: off, the default (single-turn on 2 cores it measured no faster: docs/rl.md).
    async_fill: float = 0.0
    # The engine over the live policy. max_model_len and max_num_seqs left at their defaults are set
    # from max_prompt_tokens + max_tokens and max(batch, data.eval_size) (a KV pool that fits, no more).
    engine: EngineConfig = field(default_factory=EngineConfig)

    def validate(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_tokens", "max_prompt_tokens"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        positive("temperature", self.temperature)  # 0 would make the logprobs of sampling meaningless
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.mode in ("sync", "async"), f"mode must be sync or async, got {self.mode!r}")
        need(
            isinstance(self.max_staleness, int)
            and not isinstance(self.max_staleness, bool)
            and self.max_staleness >= 0,
            f"max_staleness must be an integer >= 0 (policy versions), got {self.max_staleness!r}",
        )
        need(
            self.async_threads is None or self.async_threads >= 1,
            f"async_threads must be >= 1 or null, got {self.async_threads}",
        )
        positive("async_timeout_s", self.async_timeout_s)
        need(
            isinstance(self.async_fill, (int, float))
            and not isinstance(self.async_fill, bool)
            and 0 <= self.async_fill <= 1,
            f"async_fill must be a number in [0, 1] (0: off), got {self.async_fill!r}",
        )
        need(
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
        need(self.mode in modes, f"mode must be one of {', '.join(modes)}, got {self.mode!r}")
        need(
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

    # The lr's cosine runs over these steps (rl_optim); about what the demo's 27 minutes hold on a 2-core CPU with
    # fast bf16 (640-710 steps measured), so its lr has come down near the floor when the budget ends the run.
    max_steps: int = 800
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
        need(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        need(self.save_every >= 0, f"save_every must be >= 0, got {self.save_every}")
        need(
            self.keep_checkpoints is None or self.keep_checkpoints >= 1,
            f"keep_checkpoints must be >= 1 or null, got {self.keep_checkpoints}",
        )
        need(self.max_bad_steps >= 1, f"max_bad_steps must be >= 1, got {self.max_bad_steps}")
        positive("max_minutes", self.max_minutes, allow_none=True)
        need(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        for name in ("minibatch_size", "micro_batch_size"):
            value = getattr(self, name)
            need(value is None or value >= 1, f"{name} must be >= 1, got {value}")
        need(self.tis_cap is None or self.tis_cap >= 1, f"tis_cap must be >= 1, got {self.tis_cap}")
        need(
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


def rl_optim() -> OptimSection:
    """RL's optimizer defaults: the lr falls along a cosine over train.max_steps to a tenth of the peak. The late,
    smaller steps settle the policy: the demo's held-out accuracy after 27 minutes, 81-91% over three runs with a
    constant lr, was 97% and 99% in two runs with this one (docs/rl.md)."""
    return OptimSection(lr=3e-5, betas=(0.9, 0.99), schedule="cosine", min_lr_ratio=0.1)


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
            need(value is None or value in registry, f"{name} {value!r} is not one of {', '.join(registry)}")
        need(self.advantage != "gae", "advantage 'gae' needs a value head: use `posttrain ppo`")
        for name in ("clip_eps_low", "clip_eps_high"):
            positive(name, getattr(self, name), allow_none=True)
        need(self.dual_clip is None or self.dual_clip > 1, f"dual_clip must be > 1, got {self.dual_clip}")
        need(self.entropy_coef >= 0, f"entropy_coef must be >= 0, got {self.entropy_coef}")


@dataclass
class KLSection:
    beta: float = 0.0  # 0: no reference model at all
    estimator: str = "k3"  # KL_ESTIMATORS key
    in_reward: bool = False  # fold -beta * KL into the reward instead of adding a loss term

    def validate(self) -> None:
        need(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        need(self.estimator in KL_ESTIMATORS, f"estimator {self.estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


@dataclass
class DAPOSection:
    """DAPO's sampling tricks; None takes the algorithm preset's switch (on for `dapo`)."""

    dynamic_sampling: bool | None = None
    max_refill_rounds: int = 3  # extra rollouts to refill a batch thinned by zero-variance groups
    overlong_penalty: bool | None = None
    overlong_cache_len: int = 8  # penalty ramps from max_tokens - cache_len to max_tokens
    overlong_penalty_factor: float = 1.0

    def validate(self) -> None:
        need(self.max_refill_rounds >= 0, f"max_refill_rounds must be >= 0, got {self.max_refill_rounds}")
        need(self.overlong_cache_len >= 1, f"overlong_cache_len must be >= 1, got {self.overlong_cache_len}")
        need(self.overlong_penalty_factor >= 0, "overlong_penalty_factor must be >= 0")


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
        need(0 <= self.gamma <= 1, f"gamma must be in [0, 1], got {self.gamma}")
        need(0 <= self.lam <= 1, f"lam must be in [0, 1], got {self.lam}")
        need(self.vf_coef >= 0, f"vf_coef must be >= 0, got {self.vf_coef}")
        positive("value_clip", self.value_clip)
        positive("value_lr", self.value_lr, allow_none=True)


@dataclass
class EvalSection:
    every: int = 0  # also evaluate every N steps (0: only before and after)
    before: bool = True  # evaluate before the first step
    max_tokens: int | None = None  # None: rollout.max_tokens
    # Write <run>/best (and best.json) at each evaluation that beats the best held-out accuracy so far: the
    # model to keep when the run drifts after its peak (posttrain.trainers.rl.best)
    save_best: bool = False

    def validate(self) -> None:
        need(self.every >= 0, f"every must be >= 0, got {self.every}")


@dataclass
class RLLogSection(LogSection):
    """The shared `log` section (report_to, project, tensorboard) and the RL loop's progress bar switch."""

    progress: bool = True  # a tqdm bar with the step's headline metrics, against the bound that ends the run

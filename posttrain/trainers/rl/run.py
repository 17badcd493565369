"""An RL run: everything one training run holds (`RLRun`), and `setup_run`, which checks the config, data
and reward functions before any compute, then loads the model, the engine over it, the optimizer and
the run directory."""

from __future__ import annotations

import copy
import dataclasses
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.algos.objective import ObjectiveParams
from posttrain.checkpoint.resume import open_run
from posttrain.checkpoint.state import Checkpointer
from posttrain.distributed.env import is_main
from posttrain.distributed.lockstep import Lockstep
from posttrain.distributed.parallel import Parallel, run_module
from posttrain.distributed.processes import join_processes, open_metrics
from posttrain.engine import LLM, EngineConfig, SamplingParams
from posttrain.envs.tool_calls import ToolCallParser
from posttrain.errors import ConfigError, PosttrainError
from posttrain.metrics import MetricsLogger
from posttrain.rewards import RewardSpec, load_reward_specs
from posttrain.rollout.episode_batch import EpisodeGroups
from posttrain.rollout.prompts import PromptSource, check_prompt_lengths, data_columns, make_prompt_source
from posttrain.rollout.scoring import OverlongShaping, reward_names
from posttrain.trainers.adapters import has_adapters, prepare_trainable
from posttrain.trainers.faults import BadStepGuard
from posttrain.trainers.lifecycle import open_checkpointer
from posttrain.trainers.optim import optimizer_for
from posttrain.trainers.packed_groups import PackedGroups, packed_forward
from posttrain.trainers.rl.async_rollout import StepConsumer, StepPrompts, check_async
from posttrain.trainers.rl.config import (
    ResolvedAlgorithm,
    RLConfig,
    batch_sizes,
    completion_budget,
    objective_params,
    rank_batch_sizes,
    resolve_algorithm,
    validate_tree,
)
from posttrain.trainers.rl.env_section import rl_episode_options
from posttrain.trainers.rl.ppo import ValueHead, save_value_head
from posttrain.trainers.schedule import scheduler_for

logger = logging.getLogger("posttrain.trainers")


@dataclass
class RLRun:
    """Everything one training run holds; built by `setup_run`, advanced by `rl_step`."""

    cfg: RLConfig
    algo: ResolvedAlgorithm
    run_dir: Path
    model: nn.Module
    tokenizer: Any
    llm: LLM
    source: PromptSource
    specs: list[RewardSpec]
    held_out: list[dict[str, Any]]
    params: SamplingParams
    overlong: OverlongShaping | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    trainable: list[nn.Parameter]
    logger: MetricsLogger | None  # None on torchrun ranks other than 0
    value_head: ValueHead | None = None
    reference: nn.Module | None = None  # a frozen copy; None with beta == 0 or with LoRA (base = adapters off)
    optimizer_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    guard: BadStepGuard | None = None  # counts skipped (non-finite) updates; set by setup_run
    checkpointer: Checkpointer | None = None  # set by setup_run
    start_step: int = 0  # RL steps already done: > 0 when resumed from a checkpoint
    parallel: Parallel | None = None  # set by setup_run: the policy as torchrun's ranks share it
    objective: ObjectiveParams | None = None  # set by setup_run: the update's loss hyperparameters
    rank_sizes: tuple[int, int, int] = (0, 0, 0)  # set by setup_run: (batch, minibatch, micro-batch) on this rank
    episodes: EpisodeGroups | None = None  # with an `env:` section: plays the rollout's episodes
    async_rollout: StepConsumer | None = None  # rollout.mode=async: the rollout thread (or rollout processes)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def uses_reference(self) -> bool:
        return self.cfg.kl.beta > 0


# ----------------------------------------------------------------------------- setup


def engine_config(cfg: RLConfig) -> EngineConfig:
    """The engine section, with max_model_len / max_num_seqs sized to the rollout when left at defaults, and
    compute_dtype auto meaning float32 under an explicit model.dtype=float32 (else auto: bf16 rollouts over the fp32
    policy where the CPU is fast in bf16; train.off_policy.mode=auto corrects what differs from the update)."""
    engine = dataclasses.replace(cfg.rollout.engine)
    defaults = EngineConfig()
    if engine.compute_dtype == "auto" and cfg.model.dtype == "float32":
        engine.compute_dtype = "float32"
    eval_tokens = cfg.eval.max_tokens or cfg.rollout.max_tokens
    if engine.max_model_len is None:
        new_tokens = completion_budget(cfg) if getattr(cfg, "env", None) is not None else eval_tokens
        engine.max_model_len = cfg.rollout.max_prompt_tokens + max(cfg.rollout.max_tokens, new_tokens)
    if engine.max_num_seqs == defaults.max_num_seqs:  # a rollout (or a held-out evaluation) in one wave
        engine.max_num_seqs = min(defaults.max_num_seqs, max(batch_sizes(cfg)[0], cfg.data.eval_size))
        engine.max_num_batched_tokens = max(engine.max_num_batched_tokens, engine.max_num_seqs)
    engine.validate()
    return engine


def reward_specs(cfg: RLConfig, source: PromptSource) -> list[RewardSpec]:
    """The reward functions of `reward:` (or the task's default), checked against the data's columns."""
    env = getattr(cfg, "env", None)
    if env is not None and not cfg.reward.functions and not getattr(source, "reward", ""):
        return []  # the environment scores its episodes (an episode it leaves unscored is unscorable)
    reward_weights = cfg.reward.weights or None  # [] with no functions: the task's default, weight 1
    columns = data_columns(source, need_prompt=env is None)
    return load_reward_specs(reward_names(cfg.reward, cfg.data, source), columns, reward_weights)


def sampling_params(cfg: RLConfig) -> SamplingParams:
    """The rollout's sampling: G samples per prompt, with the engine's logprobs of every token."""
    return SamplingParams(
        n=cfg.rollout.samples_per_prompt,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_tokens,
        logprobs=True,
    )


def overlong_shaping(cfg: RLConfig, algo: ResolvedAlgorithm) -> OverlongShaping | None:
    """DAPO's overlong penalty, when the algorithm has one; an episode's length is its turns' and observations':
    not shaped."""
    if not algo.overlong_penalty or getattr(cfg, "env", None) is not None:
        return None
    return OverlongShaping(cfg.rollout.max_tokens, cfg.dapo.overlong_cache_len, cfg.dapo.overlong_penalty_factor)


def setup_run(
    cfg: RLConfig,
    command: str,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    make_env: Any = None,
    parser: ToolCallParser | None = None,
) -> RLRun:
    """Check everything that can be checked without compute (config, data, reward signatures), then
    load the model, build the engine over it, the optimizer and the run directory. `make_env` / `parser`:
    the `env:` section's environment factory and tool-call parser given in Python instead of by name."""
    validate_tree(cfg)
    algo = resolve_algorithm(cfg)
    dist_section = cfg.dist
    ctx, model_section = join_processes(dist_section, cfg.model)
    env = getattr(cfg, "env", None)
    source = make_prompt_source(cfg.data, whole_rows=env is not None)
    specs = reward_specs(cfg, source)
    held_out = source.held_out(cfg.data.eval_size) if cfg.data.eval_size else []
    if (model is None) != (tokenizer is None):
        raise PosttrainError("pass both model= and tokenizer= (or neither, to load model.name_or_path)")
    start = open_run(command, cfg)  # an occupied --out fails here, before the model loads
    run_dir = start.run_dir
    if model is None:
        from posttrain.models.hub import load_model

        model, tokenizer = load_model(
            model_section.name_or_path,
            dtype=model_section.dtype,
            device=model_section.device,
            chat_template=model_section.chat_template,
        )
    if env is None:  # episodes: the environment makes each prompt, checked when it does
        check_prompt_lengths(source, held_out, tokenizer, cfg.rollout.max_prompt_tokens)
    episodes = None
    if env is not None:
        episodes = EpisodeGroups(rl_episode_options(cfg, env, tokenizer, make_env=make_env, parser=parser))
    # The adapters' random initial weights come from one seed on every rank: FSDP2 keeps each rank's shard of
    # what that rank drew (DDP would broadcast rank 0's), so the ranks must all draw one process's values.
    torch.manual_seed(cfg.train.seed)
    prepare_trainable(model, lora=cfg.lora, quant=cfg.quant)  # adapters (over a quantized base with quant)
    # Each rank's unseeded rollouts draw from their own stream (rank 0's is the single-process one).
    torch.manual_seed(cfg.train.seed + ctx.rank)
    reference = None
    if cfg.kl.beta > 0 and not has_adapters(model):
        reference = copy.deepcopy(model).eval().requires_grad_(False)  # a whole frozen copy on every rank
    value_head = None
    if algo.uses_value_head:  # PPO's critic on the policy trunk; reduced (DDP) or sharded (FSDP2) with the trunk
        value_head = ValueHead(model.config.hidden_size, model.dtype, model.device)
    beside = {"value_head": value_head} if value_head is not None else None
    # Before the optimizer: FSDP2 replaces the Parameters by shards.
    parallel = Parallel(model, dist_section, ctx, beside=beside, compute_dtype=model_section.autocast_dtype(model))
    check_async(cfg, parallel.world)
    if cfg.rollout.mode == "async":  # checkpoints keep the prompts of steps not yet trained (StepPrompts)
        source = StepPrompts(source)
    try:
        rank_sizes = rank_batch_sizes(
            cfg, parallel.world
        )  # every rank the same whole groups, minibatches, micro-batches
    except ValueError as error:
        raise ConfigError(str(error)) from None
    optim = cfg.optim
    optimizer = optimizer_for(model, optim)
    if value_head is not None:  # its own group: a fresh head learns at its own (higher) rate
        optimizer.add_param_group(
            {"params": list(value_head.parameters()), "lr": cfg.ppo.value_lr or optim.lr * 100, "weight_decay": 0.0}
        )
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    batch, minibatch, _ = batch_sizes(cfg)
    total = cfg.train.max_steps * cfg.train.epochs * (batch // minibatch)  # optimizer steps
    scheduler = scheduler_for(optimizer, optim, total)
    with parallel.rollout():  # no forward: the engine sizes its KV pool from the (gathered) parameters' dtype
        llm = LLM(model=model, tokenizer=tokenizer, config=engine_config(cfg))
    params = sampling_params(cfg)
    overlong = overlong_shaping(cfg, algo)
    logger = open_metrics(run_dir, cfg) if is_main() else None
    run = RLRun(
        cfg,
        algo,
        run_dir,
        model,
        tokenizer,
        llm,
        source,
        specs,
        held_out,
        params,
        overlong,
        optimizer,
        scheduler,
        trainable,
        logger,
        value_head,
        reference,
        guard=BadStepGuard(cfg.train.max_bad_steps),
        parallel=parallel,
        objective=objective_params(cfg, algo, rollout_mismatch=_announce_mismatch(cfg, parallel, llm)),
        rank_sizes=rank_sizes,
        episodes=episodes,
    )
    # Rollouts draw from torch's generator (unseeded requests), which the checkpoint restores; a reference
    # copy was taken above from the initial weights, before any restore.
    run.checkpointer, run.start_step = open_checkpointer(
        command,
        cfg,
        start,
        model,
        tokenizer,
        optimizer,
        scheduler,
        parallel,
        state={"prompts": source, "faults": run.guard, "counters": _Counters(run)},
        modules={"value_head": value_head} if value_head is not None else None,
        write_extras=(lambda d: save_value_head(value_head, d)) if value_head is not None else None,
    )
    return run


def _announce_mismatch(cfg: RLConfig, parallel: Parallel, llm: LLM) -> bool:
    """Whether the engine computes in another dtype than the update; says so once, with the correction
    train.off_policy.mode=auto turns on for it (the engine's logprobs are then a slightly other policy's)."""
    update_dtype = parallel.compute_autocast[1] if parallel.compute_autocast is not None else parallel.model.dtype
    if llm.compute_dtype == update_dtype:
        return False
    correction = cfg.train.off_policy_params(rollout_mismatch=True)
    what = "no correction" if correction is None else f"{correction.mode} per {correction.level}"
    logger.info(
        "posttrain: the rollout engine computes in %s and the update in %s; off-policy correction: %s "
        "(train.off_policy)",
        str(llm.compute_dtype).removeprefix("torch."),
        str(update_dtype).removeprefix("torch."),
        what if correction is None or correction.mode != "tis" else f"{what}, cap {correction.cap}",
    )
    return True


def rollout_weights(run: RLRun) -> AbstractContextManager[Lockstep]:
    """The weights the engine runs on (see `Parallel.rollout`); one process: the model as it is."""
    return run.parallel.rollout() if run.parallel is not None else nullcontext(Lockstep.off())


def policy_forward(run: RLRun, module: nn.Module, pack: PackedGroups, **kwargs: Any) -> Any:
    """packed_forward of `module`; the policy goes through its DDP / FSDP2 wrapper, a frozen copy does not."""
    temperature = run.cfg.rollout.temperature
    return run_module(run.parallel, module, lambda m, p: packed_forward(m, p, temperature, **kwargs), pack)


class _Counters:
    """The run's optimizer-step count and the engine's policy version, as checkpoint state."""

    def __init__(self, run: RLRun) -> None:
        self.run = run

    def state_dict(self) -> dict[str, int]:
        return {"optimizer_steps": self.run.optimizer_steps, "policy_version": self.run.llm.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run.optimizer_steps = int(state["optimizer_steps"])
        # The engine's version only counts up; on a fresh, idle engine each bump just clears an empty cache.
        while self.run.llm.policy_version < int(state["policy_version"]):
            self.run.llm.weights_updated()

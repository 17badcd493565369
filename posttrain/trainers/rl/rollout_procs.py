"""Rollout processes (`dist.rollout_ranks: M`, launched with `--nproc M+1`): rank 0 trains, the last M ranks only
generate, each on its own copy of the weights (docs/distributed.md "Rollout processes").

A rollout rank loads the model and the data as the trainer does, and loops over the steps: collect step t's
groups (its share of them: places r, r + M, ... among the step's prompts; every prompt seeded from (train.seed,
t, its place), so whichever rank samples a prompt draws what one process would), send them to the trainer, and
take the trainer's weights when they come. It starts step t only once it holds the weights after step
t - 1 - lead, lead = rollout.max_staleness // (optimizer steps per RL step) as in one process (`async_rollout`);
in sync mode lead = 0, and the run is the one-process sync run (with rollout.seed_prompts).

The trainer consumes the batches through the rollout producer interface (`rollout.producer`): `ProcessProducer`
receives each step's shares and puts them back in place order, and after every update broadcasts the weights
(`distributed.weight_sync`: the LoRA adapters only, with LoRA). `ProcessRollout` stands where the in-process
`AsyncRollout` does (`RLRun.async_rollout`): it checks every sample against the staleness bound (regenerating a
stale group on the trainer's own engine) and reports the async/* metrics, the weight sync's time and size among
them.

Resume: each share carries the prompt source's state after the step's draws; the trainer keeps it, so its
checkpoint after step t holds where the prompts of step t + 1 start, which a resumed run sends to the rollout
ranks with its weights: in-flight batches are not saved but regenerated, from the same prompts and seeds.
Faults: see `distributed.rollout_link` (every wait is bounded by dist.rollout_timeout_s; the error names the rank).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.distributed.env import DistContext
from posttrain.distributed.rollout_link import RolloutLink, join_with_rollout_ranks
from posttrain.distributed.weight_sync import STOP, SyncStats, WeightBroadcast, synced_parameters
from posttrain.engine import LLM, SamplingParams
from posttrain.rewards import RewardSpec
from posttrain.rollout.batch import concat_batches
from posttrain.rollout.collect import RolloutStats, collect_rollout, prompt_seed_base
from posttrain.rollout.episode_batch import EpisodeGroups
from posttrain.rollout.generate import generate_groups
from posttrain.rollout.producer import ProducedBatch, ProducerTiming
from posttrain.rollout.prompts import PromptSource, make_prompt_source
from posttrain.rollout.scoring import OverlongShaping
from posttrain.trainers.adapters import prepare_trainable
from posttrain.trainers.rl.async_rollout import StepConsumer, lead_steps
from posttrain.trainers.rl.config import RLConfig, resolve_algorithm, validate_tree
from posttrain.trainers.rl.env_section import rl_episode_options
from posttrain.trainers.rl.metrics import collection_metrics
from posttrain.trainers.rl.run import (
    RLRun,
    engine_config,
    overlong_shaping,
    reward_specs,
    sampling_params,
)


def model_device(cfg: RLConfig) -> str:
    return cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")


def join_rollout_link(cfg: RLConfig) -> tuple[DistContext, RolloutLink]:
    """This process's side of a run with rollout processes (see `distributed.rollout_link`)."""
    dist = cfg.dist
    return join_with_rollout_ranks(dist.rollout_ranks, dist.rollout_timeout_s, torch.device(model_device(cfg)).type)


def run_lead(cfg: RLConfig) -> int:
    """Steps the rollout ranks run ahead of the update: 0 in sync mode (the sync run), else as in one process."""
    return lead_steps(cfg) if cfg.rollout.mode == "async" else 0


@dataclass
class Share:
    """What one rollout rank sends for one step: its groups of the step, scored, and what the trainer keeps."""

    step: int
    produced: ProducedBatch
    source_state: dict[str, Any]  # the prompt source after the step's draws (every rollout rank draws alike)


# ----------------------------------------------------------------------------- the rollout ranks


@dataclass
class _RolloutSide:
    model: nn.Module
    llm: LLM
    source: PromptSource
    specs: list[RewardSpec]
    params: SamplingParams
    overlong: OverlongShaping | None
    dynamic_sampling: bool
    episodes: EpisodeGroups | None


def _collect(cfg: RLConfig, side: _RolloutSide, ctx: DistContext, step: int) -> ProducedBatch:
    """This rank's share of step `step` (places ctx.rank, ctx.rank + M, ...), scored, with the collection's
    metrics (those of `step.collect_step`)."""
    shard = (lambda items: list(items[ctx.rank :: ctx.world_size])) if ctx.world_size > 1 else None
    batch, stats = collect_rollout(
        side.llm,
        side.source,
        cfg.rollout.prompts_per_step,
        side.params,
        side.specs,
        side.overlong,
        side.dynamic_sampling,
        cfg.dapo.max_refill_rounds,
        shard=shard,
        seed_base=prompt_seed_base(cfg.train.seed, step),
        generate=side.episodes or generate_groups,
    )
    metrics = collection_metrics(stats, batch, side.dynamic_sampling, side.episodes)
    return ProducedBatch(step, batch, stats, metrics)


def _rollout_side(cfg: RLConfig, model: nn.Module | None, tokenizer: Any, **env_args: Any) -> _RolloutSide:
    """What a rollout rank holds: the model (its adapters drawn as the trainer draws them; the weights that
    count come from the trainer), the engine over it, the prompt source and the reward functions."""
    validate_tree(cfg)
    algo = resolve_algorithm(cfg)
    env = getattr(cfg, "env", None)
    source = make_prompt_source(cfg.data, whole_rows=env is not None)
    specs = reward_specs(cfg, source)
    if model is None:
        from posttrain.models.hub import load_model

        device = model_device(cfg)
        if torch.device(device).type == "cuda":
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        model, tokenizer = load_model(
            cfg.model.name_or_path, dtype=cfg.model.dtype, device=device, chat_template=cfg.model.chat_template
        )
    episodes = None
    if env is not None:
        episodes = EpisodeGroups(rl_episode_options(cfg, env, tokenizer, **env_args))
    torch.manual_seed(cfg.train.seed)
    prepare_trainable(model, lora=cfg.lora, quant=cfg.quant)  # the same parameters (and names) as the trainer's
    llm = LLM(model=model, tokenizer=tokenizer, config=engine_config(cfg))
    return _RolloutSide(
        model, llm, source, specs, sampling_params(cfg), overlong_shaping(cfg, algo), algo.dynamic_sampling, episodes
    )


def _take_weights(sync: WeightBroadcast, llm: LLM) -> SyncStats:
    """The trainer's next weights (or STOP) into the model; the engine's version follows the trainer's."""
    stats = sync.receive()
    if stats.version != STOP:
        while llm.policy_version < stats.version:  # drops the prefix cache, bumps the version
            llm.weights_updated()
    return stats


def serve_rollouts(
    cfg: RLConfig,
    ctx: DistContext,
    link: RolloutLink,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    **env_args: Any,
) -> Path:
    """A rollout rank's whole run: collect and send each step's share, take the weights after each update,
    until the trainer says stop. Returns the run directory (the trainer's)."""
    side = _rollout_side(cfg, model, tokenizer, **env_args)
    start = link.broadcast_object(None, "the run's start (start step, prompt state)")
    link.introduce()
    side.source.load_state_dict(start["source_state"])
    sync = WeightBroadcast(synced_parameters(side.model), link.weights_group)
    _take_weights(sync, side.llm)  # the trainer's weights at the start (a resumed run's, or its adapters' init)
    held = start["start_step"]  # the last step whose update the held weights include
    step = held + 1
    lead = start["lead"]
    while True:
        if step <= cfg.train.max_steps and step - 1 - lead <= held:
            produced = _collect(cfg, side, ctx, step)
            share = Share(step, produced, side.source.state_dict())
            link.send_object(share, link.trainer_rank, f"sending step {step}'s rollout")
            step += 1
            continue
        if _take_weights(sync, side.llm).version == STOP:
            break
        held += 1
    link.flush(link.trainer_rank, "the last rollout sent")
    return Path(start["run_dir"])


# ----------------------------------------------------------------------------- the trainer


def merge_shares(shares: list[Share]) -> ProducedBatch:
    """The step's batch from the rollout ranks' shares, in the places one process gives its groups (rank r's
    group i is the step's group r + i * M)."""
    first = shares[0].produced
    batches = [share.produced.batch for share in shares]
    stats = RolloutStats(
        rollout_s=max(s.produced.stats.rollout_s for s in shares),
        reward_s=max(s.produced.stats.reward_s for s in shares),
        generated_tokens=sum(s.produced.stats.generated_tokens for s in shares),
        zero_variance_frac=sum(s.produced.stats.zero_variance_frac for s in shares) / len(shares),
        refill_rounds=first.stats.refill_rounds,  # refill decisions are taken over every rollout rank together
        extra_prompts=first.stats.extra_prompts,
        dropped_groups=first.stats.dropped_groups,
    )
    metrics = {**first.metrics, "tokens/rollout_per_s": stats.generated_tokens / max(stats.rollout_s, 1e-9)}
    if any(batch is None for batch in batches):  # dynamic sampling kept no group (on every rank alike)
        return ProducedBatch(first.step, None, stats, metrics)
    M = len(batches)
    offsets = [sum(b.num_groups for b in batches[:r]) for r in range(M)]
    total = offsets[-1] + batches[-1].num_groups
    order = [offsets[g % M] + g // M for g in range(total)]
    return ProducedBatch(first.step, concat_batches(batches).select_groups(order), stats, metrics)


class ProcessProducer:
    """The rollout producer (`rollout.producer.RolloutProducer`) over rollout processes, on the trainer."""

    def __init__(self, run: RLRun, link: RolloutLink, first_step: int, lead: int) -> None:
        self.run, self.link, self.lead = run, link, lead
        self.last_step = run.cfg.train.max_steps
        self.taken = first_step - 1  # the last step whose batch was taken
        self.synced = first_step - 1  # the last step whose weights were sent
        self.failed = False
        self._timing = ProducerTiming()
        self.last_sync: SyncStats | None = None
        start = {
            "start_step": first_step - 1,
            "source_state": run.source.state_dict(),
            "run_dir": str(run.run_dir),
            "lead": lead,
        }
        self._guarded(lambda: link.broadcast_object(start, "the run's start"))
        self._guarded(link.introduce)
        self.sync = WeightBroadcast(synced_parameters(run.model), link.weights_group)
        self._guarded(lambda: self._send_weights("the weights' broadcast at the start"))

    def _send_weights(self, what: str) -> SyncStats:
        with self.link.failures(what):
            return self.sync.send(self.run.llm.policy_version)

    def _guarded(self, fn: Any) -> Any:
        try:
            return fn()
        except Exception:
            self.failed = True  # the other side is gone or stuck: close() must not wait on it again
            raise

    def get(self, step: int) -> ProducedBatch:
        if step != self.taken + 1:
            raise ValueError(f"rollout processes deliver steps in order: asked for {step}, next is {self.taken + 1}")
        shares = []
        for rank in self.link.rollout_ranks:
            share = self._guarded(lambda r=rank: self.link.recv_object(r, f"the rollout of step {step}"))
            shares.append(share)
        self.taken = step
        self.run.source.load_state_dict(shares[-1].source_state)  # the checkpoint's prompt state (resume)
        busy = max(s.produced.stats.rollout_s + s.produced.stats.reward_s for s in shares)
        self._timing.busy_s += busy
        return merge_shares(shares)

    def update_done(self, step: int) -> None:
        """Broadcast the weights after `step`'s update to the rollout ranks."""
        self.last_sync = self._guarded(lambda: self._send_weights(f"the weights' broadcast after step {step}"))
        self.synced = step

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the trainer's engine is its own: no rollout runs on it

    def timing(self) -> ProducerTiming:
        return ProducerTiming(self._timing.busy_s, self._timing.idle_s)

    def close(self) -> None:
        """Tell the rollout ranks to stop, and take the batches they had sent ahead (unused)."""
        if self.failed:
            return
        self.failed = True  # once
        self.sync.send_stop()
        in_flight = min(self.synced + 1 + self.lead, self.last_step) - self.taken
        for _ in range(max(in_flight, 0)):
            for rank in self.link.rollout_ranks:
                self.link.recv_object(rank, "a rollout sent ahead")


class ProcessRollout(StepConsumer):
    """`RLRun.async_rollout` with rollout processes: what `AsyncRollout` is in one process (take a step's batch
    within the staleness bound, tell the producer the update is done, the async/* metrics) plus the weight sync's."""

    def __init__(self, run: RLRun, link: RolloutLink) -> None:
        # Until close: torchrun's SIGTERM (another process exited) stops the run with a RolloutRankError.
        self._signals = contextlib.ExitStack()
        self._signals.enter_context(link.stop_on_sigterm(on_stop=self._stopped))
        max_staleness = run.cfg.rollout.max_staleness if run.cfg.rollout.mode == "async" else 0
        super().__init__(run, ProcessProducer(run, link, run.start_step + 1, run_lead(run.cfg)), max_staleness)

    def step_done(self, step: int) -> dict[str, float]:
        metrics = super().step_done(step)
        if self.producer.last_sync is not None:
            metrics.update(self.producer.last_sync.metrics())
        return metrics

    def _stopped(self) -> None:
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.failed = True  # the rollout side is gone: close() waits on nothing

    def close(self) -> None:
        try:
            self.producer.close()
        finally:
            self._signals.close()

"""Rollouts for the RL trainers: prompts in, scored groups of completions out.

- `make_prompt_source`: a built-in task (`posttrain.tasks`) or a JSONL dataset with a prompt column.
- `reward_names`: the reward functions a run scores with (`posttrain.rewards.load_reward_specs` loads them).
- `generate_groups`: one engine call over the LIVE policy module, n samples per prompt, with the
  engine's sampling logprobs; `score_groups` adds rewards (NaN = unscorable) and DAPO's soft
  overlong penalty.
- `collect_rollout`: the step's batch; with DAPO dynamic sampling it drops groups whose task rewards
  (before the overlong penalty) are all equal and samples more prompts to refill the batch, a bounded
  number of rounds.
- `evaluate`: greedy (temperature 0) accuracy on held-out prompts through the same engine.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.algos import dapo_dynamic_sampling_mask, soft_overlong_penalty
from posttrain.data.readers import read_json_rows
from posttrain.distributed.env import all_gather_objects
from posttrain.engine import LLM, SamplingParams
from posttrain.errors import PosttrainError
from posttrain.rewards import COMPLETION_IDS_COLUMN, RewardSpec, compute_rewards
from posttrain.trainers.rl_config import TASK_DEFAULT_REWARDS, DataSection, RewardSection

PROMPT_KEY = "prompt"  # every row handed to the trainer carries its prompt under this key


# ----------------------------------------------------------------------------- prompt sources


class PromptSource(Protocol):
    reward: str  # the default reward spec for this data

    def sample(self, n: int) -> list[dict[str, Any]]: ...

    def held_out(self, n: int) -> list[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...  # plain JSON: where sampling stands, for exact resume

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def prompt_row(
    record: dict[str, Any], prompt_column: str, where: str, template: str | None = None, system_prompt: str | None = None,
) -> dict[str, Any]:
    """A dataset record as a rollout row: the prompt column becomes `prompt` (a string gets `template`,
    formatted with the record's columns, and `system_prompt`, and becomes a one-turn chat); the other
    columns stay for the reward functions. `where` (file:line) names the record in errors."""
    prompt = record[prompt_column]
    columns = {k: v for k, v in record.items() if k != prompt_column}
    if isinstance(prompt, str):
        try:
            text = template.format(**record) if template else prompt
        except (KeyError, IndexError, ValueError) as error:
            raise PosttrainError(f"{where}: prompt template {template!r} cannot be filled from this row "
                                 f"({type(error).__name__}: {error}; columns: {', '.join(record)})") from None
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompt = messages + [{"role": "user", "content": text}]
    elif not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)):
        raise PosttrainError(f"{where}: column {prompt_column!r} must be a string or a list of chat messages")
    return {**columns, PROMPT_KEY: prompt}


class JsonlPrompts:
    """Rows of a JSONL file; the prompt column becomes `prompt` (a string gets the template and system
    prompt and becomes a one-turn chat). The last `eval_size` rows are held out; training cycles over
    the rest in an order reshuffled each epoch."""

    reward = ""  # no default: `reward.functions` must name one

    def __init__(self, cfg: DataSection) -> None:
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise PosttrainError(f"data.path: {path} not found")
        rows = []
        for number, record in read_json_rows(path):  # bad JSON / UTF-8: a DataError naming file:line:column
            if cfg.prompt_column not in record:
                raise PosttrainError(f"{path}:{number}: no prompt column {cfg.prompt_column!r} "
                                     f"(columns: {', '.join(record) or 'none'}); set data.prompt_column")
            rows.append(self._to_row(record, cfg, f"{path}:{number}"))
        if len(rows) <= cfg.eval_size:
            raise PosttrainError(f"{path}: {len(rows)} rows, not enough for data.eval_size={cfg.eval_size} held out "
                                 "plus training rows")
        split = len(rows) - cfg.eval_size
        self.train_rows, self.held_out_rows = rows[:split], rows[split:]
        self.rng = random.Random(cfg.seed)
        self.order: list[int] = []

    @staticmethod
    def _to_row(record: dict[str, Any], cfg: DataSection, where: str) -> dict[str, Any]:
        return prompt_row(record, cfg.prompt_column, where, cfg.prompt_template, cfg.system_prompt)

    def sample(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            if not self.order:
                self.order = list(range(len(self.train_rows)))
                self.rng.shuffle(self.order)
            out.append(dict(self.train_rows[self.order.pop()]))
        return out

    def held_out(self, n: int) -> list[dict[str, Any]]:
        return [dict(row) for row in self.held_out_rows[:n]]

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss = self.rng.getstate()
        return {"rng": [version, list(words), gauss], "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, words, gauss = state["rng"]
        order = [int(i) for i in state["order"]]
        if any(not 0 <= i < len(self.train_rows) for i in order):
            raise PosttrainError(f"prompt source state: row index out of range for {len(self.train_rows)} training "
                                 "rows (a different data file?)")
        self.rng.setstate((version, tuple(words), gauss))
        self.order = order


def make_prompt_source(cfg: DataSection) -> PromptSource:
    """A built-in task (its `path` option from data.path, if given) or a JSONL dataset."""
    if cfg.task is None:
        return JsonlPrompts(cfg)
    from posttrain.tasks import make_task

    options: dict[str, Any] = {"seed": cfg.seed}
    if cfg.path is not None:
        options["path"] = cfg.path
    if cfg.task == "gsm8k":
        options["held_out_size"] = max(cfg.eval_size, 1)
    return make_task(cfg.task, **options)


def data_columns(source: PromptSource) -> list[str]:
    """The data's columns a reward function receives: every row key but the prompt."""
    first = (source.held_out(1) or source.sample(1))[0]
    if PROMPT_KEY not in first:
        raise PosttrainError(f"the data's rows have no {PROMPT_KEY!r} (columns: {', '.join(first)})")
    return [k for k in first if k != PROMPT_KEY]


def reward_names(cfg: RewardSection, data: DataSection, source: PromptSource) -> list[str]:
    """`reward.functions`, or the task's default reward when it names none."""
    if cfg.functions:
        return list(cfg.functions)
    default = getattr(source, "reward", "") or TASK_DEFAULT_REWARDS.get(data.task or "", "")
    if not default:
        raise PosttrainError("reward.functions is empty and the data has no default reward: name one, "
                             "e.g. reward.functions=[numeric_match]")
    return [default]


def check_prompt_lengths(source: PromptSource, held_out: list[dict[str, Any]], tokenizer: Any, limit: int) -> None:
    """Every prompt the run can draw (a task's or dataset's training rows when it exposes them, and the
    held-out rows) must fit `rollout.max_prompt_tokens` once templated; else fail now, naming the row."""
    rows = list(getattr(source, "train_rows", [])) + list(held_out)
    for index, row in enumerate(rows):
        ids = tokenizer.apply_chat_template(list(row[PROMPT_KEY]), add_generation_prompt=True, tokenize=True)
        if len(ids) > limit:
            where = f"training row {index}" if index < len(rows) - len(held_out) else "a held-out row"
            raise PosttrainError(f"data: {where} has a prompt of {len(ids)} tokens, more than "
                                 f"rollout.max_prompt_tokens={limit}; raise it (or drop long rows)")


# ----------------------------------------------------------------------------- rollouts


@dataclass
class RolloutBatch:
    """G samples per group, samples numbered group by group (sample b = g * G + j)."""

    group_size: int
    rows: list[dict[str, Any]]  # per group: the prompt and its columns
    prompt_ids: list[list[int]]  # per group
    completion_ids: list[list[int]]  # per sample
    texts: list[str]  # per sample
    rollout_logprobs: list[list[float]]  # per sample: the engine's log softmax(z / T) of each token
    finish_reasons: list[str]  # per sample
    policy_versions: list[int]  # per sample
    rewards: torch.Tensor | None = None  # (B,) after shaping; NaN = unscorable
    task_rewards: torch.Tensor | None = None  # (B,) before the overlong penalty
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_errors: list[str] = field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    @property
    def num_samples(self) -> int:
        return len(self.completion_ids)

    def group_completions(self) -> list[list[list[int]]]:
        G = self.group_size
        return [self.completion_ids[g * G : (g + 1) * G] for g in range(self.num_groups)]

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        G = self.group_size
        samples = [g * G + j for g in groups for j in range(G)]
        index = torch.tensor(samples, dtype=torch.long)

        def pick(values: Any) -> Any:
            if values is None:
                return None
            if isinstance(values, torch.Tensor):
                return values[index]
            return [values[b] for b in samples]

        return replace(
            self,
            rows=[self.rows[g] for g in groups],
            prompt_ids=[self.prompt_ids[g] for g in groups],
            completion_ids=pick(self.completion_ids),
            texts=pick(self.texts),
            rollout_logprobs=pick(self.rollout_logprobs),
            finish_reasons=pick(self.finish_reasons),
            policy_versions=pick(self.policy_versions),
            rewards=pick(self.rewards),
            task_rewards=pick(self.task_rewards),
            per_function={k: pick(v) for k, v in self.per_function.items()},
        )


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    first = batches[0]

    def cat(name: str) -> Any:
        values = [getattr(b, name) for b in batches]
        if isinstance(values[0], torch.Tensor):
            return torch.cat(values)
        return [v for vs in values for v in vs]

    return replace(
        first,
        **{name: cat(name) for name in ("rows", "prompt_ids", "completion_ids", "texts", "rollout_logprobs",
                                        "finish_reasons", "policy_versions", "rewards", "task_rewards")},
        per_function={k: torch.cat([b.per_function[k] for b in batches]) for k in first.per_function},
        reward_errors=[e for b in batches for e in b.reward_errors],
    )


EngineCall = Callable[[], AbstractContextManager[None]]  # a context around one engine call: `Parallel.rollout`'s


def generate_groups(llm: LLM, rows: list[dict[str, Any]], params: SamplingParams,
                    seeds: list[int] | None = None, use_tqdm: bool = False,
                    lockstep: EngineCall = nullcontext) -> RolloutBatch:
    """n = params.n samples of each row's prompt from the engine, with their sampling logprobs; with `seeds`,
    row i's request is seeded with seeds[i] (its samples then depend on nothing else: not on the batch).
    `use_tqdm`: the engine's progress bar over the prompts. `lockstep`: the engine call runs inside it (under
    torchrun with `dist.rollout_weights=per_layer`, every rank's call together)."""
    per_row: SamplingParams | list[SamplingParams] = params
    if seeds is not None:
        per_row = [replace(params, seed=seed) for seed in seeds]
    with lockstep():
        outputs = llm.generate([row[PROMPT_KEY] for row in rows], per_row, use_tqdm=use_tqdm)
    completion_ids, texts, logprobs, reasons, versions = [], [], [], [], []
    for output in outputs:
        for sample in output.outputs:
            completion_ids.append(list(sample.token_ids))
            texts.append(sample.text)
            logprobs.append(list(sample.logprobs or []))
            reasons.append(sample.finish_reason or "length")
            versions.append(sample.policy_version if sample.policy_version is not None else -1)
    return RolloutBatch(
        group_size=params.n,
        rows=list(rows),
        prompt_ids=[list(o.prompt_token_ids) for o in outputs],
        completion_ids=completion_ids,
        texts=texts,
        rollout_logprobs=logprobs,
        finish_reasons=reasons,
        policy_versions=versions,
    )


@dataclass(frozen=True)
class OverlongShaping:
    max_tokens: int
    cache_len: int
    factor: float


def score_groups(batch: RolloutBatch, specs: list[RewardSpec], overlong: OverlongShaping | None) -> RolloutBatch:
    """Rewards for every sample (the group's row columns repeated per sample), then the overlong penalty."""
    G = batch.group_size
    prompts = [row[PROMPT_KEY] for row in batch.rows for _ in range(G)]
    names = [k for k in batch.rows[0] if k != PROMPT_KEY]
    columns: dict[str, list[Any]] = {k: [row.get(k) for row in batch.rows for _ in range(G)] for k in names}
    columns[COMPLETION_IDS_COLUMN] = batch.completion_ids
    result = compute_rewards(specs, prompts, batch.texts, columns)
    rewards = result.total.clone()  # (B,)
    if overlong is not None:
        lengths = torch.tensor([len(ids) for ids in batch.completion_ids], dtype=torch.float32)
        rewards = rewards + soft_overlong_penalty(lengths, overlong.max_tokens, overlong.cache_len,
                                                  penalty_factor=overlong.factor)
    return replace(batch, rewards=rewards, task_rewards=result.total, per_function=result.per_function,
                   reward_errors=result.errors)


@dataclass
class RolloutStats:
    rollout_s: float = 0.0
    reward_s: float = 0.0
    generated_tokens: int = 0
    zero_variance_frac: float = 0.0  # of the first round's groups: those dynamic sampling drops
    refill_rounds: int = 0
    extra_prompts: int = 0  # prompts sampled beyond prompts_per_step to refill
    dropped_groups: int = 0


def zero_variance_groups(batch: RolloutBatch) -> torch.Tensor:
    """(num_groups,) bool: the groups DAPO's dynamic sampling drops, decided on correctness.

    DAPO (eq. 11) keeps a group when 0 < #correct < G, and verl filters on `acc` (the scorer's
    correctness, before its overlong penalty) by keeping groups whose values have std > 0. Here: the
    task rewards (the reward functions' total, before the soft overlong penalty) must not all be equal.
    For a 0/1 reward that is exactly 0 < #correct < G. For a graded reward (partial credit, a format
    bonus) a group whose task rewards differ still carries a task signal and is kept; a threshold on
    "correct" would throw that away. A group whose only spread is the length penalty (all wrong, some
    overlong) is dropped: it would train on length alone. The advantage still uses the shaped rewards.
    Groups with < 2 scorable rewards are dropped too (see dapo_dynamic_sampling_mask)."""
    task = batch.task_rewards if batch.task_rewards is not None else batch.rewards  # (B,)
    keep = dapo_dynamic_sampling_mask(task, batch.group_size).reshape(-1, batch.group_size)[:, 0]  # (N,)
    return ~keep


def prompt_seed_base(seed: int, step: int) -> int:
    """The seed of the step's first prompt with rollout.seed_prompts (see collect_rollout); steps stay apart
    by 2**24 seeds (prompts x samples of a step)."""
    return (seed * 1_000_003 + step) << 24


def collect_rollout(
    llm: LLM,
    source: PromptSource,
    num_prompts: int,
    params: SamplingParams,
    specs: list[RewardSpec],
    overlong: OverlongShaping | None,
    dynamic_sampling: bool,
    max_refill_rounds: int,
    shard: Callable[[list[Any]], list[Any]] | None = None,
    seed_base: int | None = None,
    lockstep: EngineCall = nullcontext,
) -> tuple[RolloutBatch | None, RolloutStats]:
    """The step's scored batch. With dynamic sampling, only groups whose task rewards differ are kept
    (correctness, not the length-shaped reward: see zero_variance_groups) and up to `max_refill_rounds`
    extra rollouts refill the batch to `num_prompts` groups; fewer may be returned, and None when no
    group is left.

    Data-parallel: every rank draws the same `num_prompts` prompts and `shard` keeps this rank's (whole
    groups: a prompt's samples stay on one rank). `seed_base`: the prompt at place p of the step's draws
    is seeded with seed_base + p * n (the engine seeds sample i with seed + i), so a prompt gets the same
    samples whichever rank, and whichever batch, it lands in.

    Dynamic sampling under data parallelism decides on the global set of groups, as one process does: the
    ranks all-gather which of their groups they keep, so every rank refills the same rounds; at the end they
    all-gather their kept groups, take the first `num_prompts` by place (the single process's batch) and deal
    them out strided again. A batch left short of `num_prompts` loses its last (count mod world size)
    groups, so that every rank trains on the same number of groups. `lockstep`: see generate_groups."""
    stats = RolloutStats()
    drawn = 0  # prompts drawn this step, over all ranks: the place of the next one
    placed: list[int] = []  # the place of each group of this rank's last round

    def one_round(n: int) -> RolloutBatch:
        nonlocal drawn, placed
        start = time.perf_counter()
        places = list(enumerate(source.sample(n), start=drawn))  # (place in the step, row)
        drawn += n
        if shard is not None:
            places = shard(places)
        placed = [place for place, _ in places]
        seeds = [seed_base + place * params.n for place, _ in places] if seed_base is not None else None
        batch = generate_groups(llm, [row for _, row in places], params, seeds, lockstep=lockstep)
        stats.rollout_s += time.perf_counter() - start
        stats.generated_tokens += sum(len(ids) for ids in batch.completion_ids)
        start = time.perf_counter()
        batch = score_groups(batch, specs, overlong)
        stats.reward_s += time.perf_counter() - start
        return batch

    batch = one_round(num_prompts)
    zero_var = zero_variance_groups(batch)
    stats.zero_variance_frac = float(zero_var.float().mean())
    if not dynamic_sampling:
        return batch, stats
    kept: list[RolloutBatch] = []
    kept_places: list[int] = []  # the place of each group of `kept`, in order
    have = 0  # groups kept so far, over every rank

    def keep(round_batch: RolloutBatch, zero: torch.Tensor) -> None:
        nonlocal have
        groups = [g for g in range(round_batch.num_groups) if not zero[g]]
        kept.append(round_batch.select_groups(groups))
        kept_places.extend(placed[g] for g in groups)
        # (kept, dropped) summed over the ranks: every rank then takes the same refill decisions.
        mine = (len(groups), int(zero.sum()))
        counts = all_gather_objects(mine) if shard is not None else [mine]
        have += sum(c[0] for c in counts)
        stats.dropped_groups += sum(c[1] for c in counts)

    keep(batch, zero_var)
    while have < num_prompts and stats.refill_rounds < max_refill_rounds:
        keep_rate = max(have / (num_prompts + stats.extra_prompts), 0.25)  # sample extra for the expected drop
        n = min(num_prompts, math.ceil((num_prompts - have) / keep_rate))
        stats.refill_rounds += 1
        stats.extra_prompts += n
        extra = one_round(n)
        keep(extra, zero_variance_groups(extra))
    kept = [b for b in kept if b.num_groups]
    merged = concat_batches(kept) if kept else None
    if shard is None:
        if merged is None:
            return None, stats
        return merged.select_groups(list(range(min(num_prompts, merged.num_groups)))), stats
    # Every rank's kept groups, ordered by place: the single process's kept batch; its first num_prompts.
    ranks = all_gather_objects((merged, kept_places))
    gathered = [(place, rank_batch, g) for rank_batch, places in ranks
                if rank_batch is not None for g, place in enumerate(places)]
    gathered.sort(key=lambda item: item[0])  # (place, the rank's kept batch, the group's index in it)
    take = min(num_prompts, len(gathered))
    take -= take % len(ranks)  # the same number of whole groups on every rank
    mine = shard(gathered[:take])
    if not mine:
        return None, stats
    return concat_batches([b.select_groups([g]) for _, b, g in mine]), stats


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    llm: LLM, rows: list[dict[str, Any]], specs: list[RewardSpec], max_tokens: int, threshold: float,
    lockstep: EngineCall = nullcontext,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy accuracy on `rows`: the share of scorable samples whose total reward is >= threshold.
    `lockstep`: see generate_groups."""
    from posttrain.tasks import accuracy

    batch = generate_groups(llm, rows, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens),
                            lockstep=lockstep)
    batch = score_groups(batch, specs, None)
    rewards = batch.rewards.tolist()
    try:
        acc = accuracy(rewards, threshold)
    except ValueError:
        acc = math.nan
    lengths = [len(ids) for ids in batch.completion_ids]
    metrics = {
        "eval/accuracy": acc,
        "eval/reward_mean": float(torch.nanmean(batch.rewards)) if rewards else math.nan,
        "eval/response_len_mean": sum(lengths) / max(len(lengths), 1),
        "eval/num_prompts": len(rows),
    }
    samples = [
        {"prompt": row[PROMPT_KEY], "completion": text, "reward": None if math.isnan(r) else r,
         **{k: v for k, v in row.items() if k != PROMPT_KEY and isinstance(v, (str, int, float))}}
        for row, text, r in zip(batch.rows, batch.texts, rewards)
    ]
    return metrics, samples

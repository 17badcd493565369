"""GRPO on multi-turn episodes (the `env:` section) with a scripted environment on a tiny random model: the
trainer's logprobs of the model's tokens are the engine's, observations never train, steps run with the
environment's metrics, the held-out evaluation plays episodes, a resumed run takes the same next step, and a
bad `env:` fails on load naming its key."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.rollout.episode_batch import episodes_to_batch
from posttrain.trainers.packed_groups import pack_groups, packed_forward
from posttrain.trainers.rl import rl_step, setup_run, train_grpo
from posttrain.trainers.rl.config import GRPOConfig
from posttrain.trainers.rl.update import prepare_batch
from tests.data.tiny import tiny_tokenizer
from tests.rollout.episode_helpers import (
    ROWS,
    ScriptedEnv,
    make_llm,
    plain_parser,
    runner,
    turn_ending_model,
    write_questions,
)

# As in test_rl_trainer.py: the engine's paged forward against the trainer's dense one, fp32 tiny models.
ENGINE_DENSE_LOGPROB_TOL = 1e-4


def test_trainer_logprobs_of_the_model_s_tokens_are_the_engine_s() -> None:
    llm = make_llm()
    play = runner(llm)
    episodes, _ = play.run(ROWS * 2, [1, 2, 3, 4])
    batch = episodes_to_batch([episodes[i] for i in (0, 2, 1, 3)], 2, play.chat, "zero", "ignore")
    assert max(e.num_turns for e in episodes) >= 2
    pack = pack_groups(batch.prompt_ids, batch.group_completions())
    with torch.no_grad():
        trainer = packed_forward(llm.engine.model, pack, temperature=1.0).logprobs  # (B, L)
    for b, (mask, engine) in enumerate(zip(batch.completion_mask, batch.rollout_logprobs)):
        model_tokens = torch.tensor(mask, dtype=torch.bool)
        diff = (trainer[b, : len(mask)] - torch.tensor(engine))[model_tokens].abs()
        assert model_tokens.sum() > 0 and diff.max() <= ENGINE_DENSE_LOGPROB_TOL, (b, diff.max())


def test_scored_packs_take_logits_at_the_model_s_tokens_only() -> None:
    """The update packs episodes with their model masks: the observation tokens stay context (the model's
    tokens get the very logprobs of the unscored pack, up to the LM head's batch shape) and get no logits."""
    llm = make_llm()
    play = runner(llm)
    episodes, _ = play.run(ROWS * 2, [1, 2, 3, 4])
    batch = episodes_to_batch([episodes[i] for i in (0, 2, 1, 3)], 2, play.chat, "zero", "ignore")
    masks = batch.grouped(batch.completion_mask)
    full = pack_groups(batch.prompt_ids, batch.group_completions())
    scored = pack_groups(batch.prompt_ids, batch.group_completions(), scored=masks)
    assert scored.labels.numel() == sum(map(sum, batch.completion_mask)) < full.labels.numel()
    with torch.no_grad():
        everything = packed_forward(llm.engine.model, full, temperature=1.0).logprobs  # (B, L)
        own = packed_forward(llm.engine.model, scored, temperature=1.0).logprobs  # (B, L)
    model_tokens = torch.zeros_like(own, dtype=torch.bool)
    for b, mask in enumerate(batch.completion_mask):
        model_tokens[b, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    assert own.shape == everything.shape and (own[~model_tokens] == 0).all()
    assert (own[model_tokens] - everything[model_tokens]).abs().max() <= ENGINE_DENSE_LOGPROB_TOL
    with pytest.raises(ValueError, match="one flag per completion token"):
        pack_groups(batch.prompt_ids, batch.group_completions(), scored=[m[:1] for m in masks])


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_questions(tmp_path / "questions.jsonl")


def _config(tmp_path: Path, data: Path, name: str, *extra: str) -> GRPOConfig:
    return load_config(
        GRPOConfig,
        None,
        [
            f"out={tmp_path / name}",
            "data.task=null",
            f"data.path={data}",
            "data.eval_size=2",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=3",
            "rollout.max_tokens=10",
            "log.progress=false",
            "train.max_minutes=null",
            "env.name=scripted",
            "env.max_turns=3",
            "env.max_episode_tokens=100",
            "optim.lr=1e-3",
            *extra,
        ],
    )


def _setup(cfg: GRPOConfig):
    return setup_run(
        cfg, "grpo", model=turn_ending_model(), tokenizer=tiny_tokenizer(), make_env=ScriptedEnv, parser=plain_parser
    )


def test_grpo_steps_on_episodes_train_the_model_s_tokens_only(tmp_path: Path, data: Path, monkeypatch) -> None:
    run = _setup(_config(tmp_path, data, "steps", "train.skip_zero_advantage=false"))  # every group in the update
    seen = []
    original = prepare_batch

    def keep(run_, batch):
        step_batch = original(run_, batch)
        seen.append((batch, step_batch))
        return step_batch

    monkeypatch.setattr("posttrain.trainers.rl.step.prepare_batch", keep)
    weights = [p.detach().clone() for p in run.model.parameters()]
    for step in (1, 2):
        metrics = rl_step(run, step)
        assert metrics["optimizer_steps"] == step == run.llm.policy_version
        for key in ("env/turns", "env/tool_calls", "env/tool_calls/echo", "env/tokens_model", "env/time_share"):
            assert math.isfinite(metrics[key]), key
        assert metrics["env/tokens_observation"] > 0 and metrics["prefix_cache/reused_tokens"] > 0
        assert metrics["mismatch/abs_diff_max"] <= ENGINE_DENSE_LOGPROB_TOL
    assert any(not torch.equal(a, b) for a, b in zip(weights, run.model.parameters()))
    for batch, step_batch in seen:  # the loss mask is the model's tokens: zero on every observation token
        for b, mask in enumerate(batch.completion_mask):
            assert step_batch.mask[b, : len(mask)].tolist() == [float(m) for m in mask]
            assert step_batch.mask[b, len(mask) :].sum() == 0


def test_a_resumed_run_takes_the_same_next_step(tmp_path: Path, data: Path) -> None:
    cfg = _config(tmp_path, data, "resume")
    whole = _setup(cfg)
    rl_step(whole, 1)
    whole.checkpointer.save(1)
    want = rl_step(whole, 2)
    cfg.resume = "auto"
    resumed = _setup(cfg)
    assert resumed.start_step == 1
    have = rl_step(resumed, 2)
    for key in ("reward/mean", "loss/policy", "grad_norm", "env/turns", "env/tokens_model", "response_len/mean"):
        assert have[key] == want[key], key
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))


def test_train_grpo_evaluates_with_episodes(tmp_path: Path, data: Path) -> None:
    cfg = _config(tmp_path, data, "e2e", "train.max_steps=1")
    run_dir = train_grpo(
        cfg, model=turn_ending_model(), tokenizer=tiny_tokenizer(), make_env=ScriptedEnv, parser=plain_parser
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and summary["steps"] == 1
    evals = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval/env/turns" in line
    ]
    assert len(evals) == 2 and all(r["eval/env/turns"] >= 1 for r in evals)
    sample = json.loads((run_dir / "eval-step00000.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0]["role"] == "user" and "result 1" in sample["completion"]


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("env.max_turns=0", "max_turns must be >= 1"),
        ("env.truncated_reward=nan", "env.truncated_reward"),
        ("env.turn_rewards=per_turn", "only a token-level advantage uses"),
        ("env.name=", "name must name an environment"),
    ],
)
def test_bad_env_sections_fail_on_load(tmp_path: Path, data: Path, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _config(tmp_path, data, "bad", override)


@pytest.mark.parametrize(
    "config, tool, data",
    [("agent_calculator.yaml", "calculator", "calculator"), ("agent_word_problems.yaml", "calculate", "word_problems")],
)
def test_the_example_config_loads_its_environment_and_fits_its_prompts(config: str, tool: str, data: str) -> None:
    from posttrain.chat_templates import load_chat_template
    from posttrain.tasks import make_task
    from posttrain.trainers.rl.env_section import episode_options
    from tests.trainers.rl_helpers import tokenizer

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(GRPOConfig, root / "examples" / config)
    tok = tokenizer()
    tok.chat_template = load_chat_template(cfg.model.chat_template)
    options = episode_options(cfg.env, tok, cfg.rollout.max_tokens, cfg.rollout.max_prompt_tokens)
    assert [tool["function"]["name"] for tool in options.chat.tools] == [tool]
    env = options.make_env()
    for row in make_task(cfg.data.task).held_out(cfg.data.eval_size):
        assert len(options.chat.opening_ids(env.reset(row))) <= cfg.rollout.max_prompt_tokens
    held_out = [json.loads(line) for line in (root / f"examples/data/{data}/test.jsonl").read_text().splitlines()]
    assert len(held_out) == 200 and all(int(r["answer"]) > 0 and r["question"] for r in held_out)


def test_async_episodes_record_a_version_per_token_within_the_bound(tmp_path: Path, data: Path, monkeypatch) -> None:
    """rollout.mode=async on episodes: every token of an episode carries a version (observations: the model token's
    before them), the update sees no sample older than max_staleness, and the episodes' metrics come through."""
    run = _setup(_config(tmp_path, data, "async", "rollout.mode=async", "rollout.max_staleness=1"))
    seen = []
    original = prepare_batch

    def keep(run_, batch):
        seen.append((run_.llm.policy_version, batch))
        time.sleep(0.2)  # a slow update: the rollout thread runs ahead meanwhile
        return original(run_, batch)

    monkeypatch.setattr("posttrain.trainers.rl.step.prepare_batch", keep)
    try:
        for step in (1, 2, 3):
            metrics = rl_step(run, step)
            assert metrics["async/staleness_max"] <= 1 and math.isfinite(metrics["env/turns"])
    finally:
        run.async_rollout.close()
    for version, batch in seen:
        for ids, versions, mask in zip(batch.completion_ids, batch.token_versions, batch.completion_mask):
            assert len(versions) == len(ids) == len(mask)
            assert versions == sorted(versions)  # weights only move forward while an episode runs
            assert min(v for v, m in zip(versions, mask) if m) >= version - 1


def test_the_guess_number_example_fits_its_prompts() -> None:
    from posttrain.chat_templates import load_chat_template
    from posttrain.tasks import make_task
    from posttrain.trainers.rl.env_section import episode_options
    from tests.trainers.rl_helpers import tokenizer

    cfg = load_config(GRPOConfig, Path(__file__).resolve().parents[2] / "examples" / "agent_guess_number.yaml")
    tok = tokenizer()
    tok.chat_template = load_chat_template(cfg.model.chat_template)
    options = episode_options(cfg.env, tok, cfg.rollout.max_tokens, cfg.rollout.max_prompt_tokens)
    env = options.make_env()
    assert env.game.max_turns == cfg.env.max_turns and not options.chat.tools  # no tools: none rendered
    for row in make_task(cfg.data.task).held_out(cfg.data.eval_size):
        opening = env.reset(row)
        assert opening[0]["role"] == "system" and "one whole number" in opening[0]["content"]
        assert len(options.chat.opening_ids(opening)) <= cfg.rollout.max_prompt_tokens
    assert env.game.show_range and cfg.train.max_minutes == 24  # the demo's budget: 30 minutes with the cold start

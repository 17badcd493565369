"""The RL loop on tiny random models: a step moves the weights the engine runs, every preset steps
without NaN, PPO's value loss falls, and bad input fails before any compute."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.cli import main as cli_main
from posttrain.config import load_config
from posttrain.engine import SamplingParams
from posttrain.errors import ConfigError, PosttrainError
from posttrain.trainers.rl import rl_step, setup_run, train_grpo, train_ppo
from posttrain.trainers.rl.config import ALGORITHMS, GRPOConfig, PPOConfig
from tests.trainers.rl_helpers import reward_file, rl_overrides, tiny_model, tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_one_step_updates_the_weights_the_engine_runs(tmp_path: Path, tok) -> None:
    cfg = load_config(GRPOConfig, None, rl_overrides(tmp_path, "step", "optim.lr=1e-2"))
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    probe = [{"role": "user", "content": "What is 40 plus 2?"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True)
    before = run.llm.generate([probe], greedy)[0].outputs[0]
    weights = _weights(run.model)
    assert run.llm.policy_version == 0
    metrics = rl_step(run, 1)
    assert metrics["optimizer_steps"] == 1
    assert run.llm.policy_version == 1 == metrics["policy_version"]
    assert "time/old_pass_s" not in metrics, "a single update needs no extra logprob pass"
    assert any(not torch.equal(a, b) for a, b in zip(weights, run.model.parameters()))
    after = run.llm.generate([probe], greedy)[0].outputs[0]
    assert after.policy_version == 1
    assert before.token_ids != after.token_ids or before.logprobs != after.logprobs, "the engine must see the step"


def test_a_step_under_the_engines_hold_gives_the_free_heap_back(tmp_path: Path, tok, monkeypatch) -> None:
    """model.cpu_memory=keep leaves the process in the engine's `hold` (nothing trims): each step then returns
    the heap's free pages once, after its update; under `release` glibc already does, so the step does not."""
    import posttrain.trainers.rl.step as step_module

    trims: list[int] = []
    monkeypatch.setattr(step_module, "return_free_memory", lambda: trims.append(1) or True)
    run = setup_run(
        load_config(GRPOConfig, None, rl_overrides(tmp_path, "trim")), "grpo", model=tiny_model(tok), tokenizer=tok
    )
    monkeypatch.setattr(step_module, "current_malloc_policy", lambda: "hold")
    assert "time/trim_s" in rl_step(run, 1) and trims == [1]
    monkeypatch.setattr(step_module, "current_malloc_policy", lambda: "release")
    assert "time/trim_s" not in rl_step(run, 2) and trims == [1]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_preset_steps_without_nan(tmp_path: Path, tok, algorithm: str) -> None:
    extra = [f"algorithm={algorithm}", "kl.beta=0.05", "train.epochs=2", "train.minibatch_size=4"]
    cfg = load_config(GRPOConfig, None, rl_overrides(tmp_path, algorithm, *extra))
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    metrics = rl_step(run, 1)
    assert metrics["optimizer_steps"] == 4  # 2 epochs x 2 minibatches
    for key in ("loss/policy", "grad_norm", "entropy", "kl", "approx_kl", "clip_frac/low", "clip_frac/high"):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_dapo_drops_zero_variance_groups_and_refills(tmp_path: Path, tok) -> None:
    extra = [
        "algorithm=dapo",
        f"reward.functions=[{reward_file(tmp_path)}:parity_gated]",
        "rollout.prompts_per_step=4",
        "dapo.max_refill_rounds=2",
    ]
    cfg = load_config(GRPOConfig, None, rl_overrides(tmp_path, "dapo-refill", *extra))
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    metrics = rl_step(run, 1)
    assert metrics["dapo/dropped_groups"] > 0 and metrics["dapo/refill_rounds"] >= 1
    assert metrics["dapo/extra_prompts"] > 0
    assert 0 < metrics["dapo/kept_groups"] <= 4 and metrics["num_samples"] == 4 * metrics["dapo/kept_groups"]


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_micro_batching_does_not_change_the_gradient(tmp_path: Path, tok, algorithm: str) -> None:
    norms = []
    for micro in (8, 4):
        extra = [f"algorithm={algorithm}", f"train.micro_batch_size={micro}", "dapo.dynamic_sampling=false"]
        cfg = load_config(GRPOConfig, None, rl_overrides(tmp_path, f"micro{algorithm}{micro}", *extra))
        run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
        norms.append(rl_step(run, 1)["grad_norm"])
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-4)


# The most a token's logprob may differ between the engine's paged forward and the trainer's dense one on
# these fp32 tiny models: the bound tests/trainers/test_rl_batch.py asserts for the same model and sampler.
ENGINE_DENSE_LOGPROB_TOL = 1e-4


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_kl_in_reward_and_tis(tmp_path: Path, tok, old_logprobs: str) -> None:
    extra = [
        "kl.beta=0.1",
        "kl.in_reward=true",
        "kl.estimator=k1",
        "train.tis_cap=2.0",
        f"train.old_logprobs={old_logprobs}",
        "train.epochs=2",
    ]
    cfg = load_config(GRPOConfig, None, rl_overrides(tmp_path, f"klr-{old_logprobs}", *extra))
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    metrics = rl_step(run, 1)
    assert math.isfinite(metrics["kl/in_reward_mean"])
    if old_logprobs == "rollout":  # pi_old is the engine's logprobs: no extra pass, and a weight of 1 exactly
        assert "time/old_pass_s" not in metrics and metrics["off_policy/weight_mean"] == 1.0
        return
    # pi_old from the trainer's own no-grad pass, at the weights that sampled: each TIS weight
    # exp(old - engine) lies within expm1(tol) of 1, and so does their mean.
    assert "time/old_pass_s" in metrics
    assert metrics["mismatch/abs_diff_max"] <= ENGINE_DENSE_LOGPROB_TOL
    assert abs(metrics["off_policy/weight_mean"] - 1.0) <= math.expm1(ENGINE_DENSE_LOGPROB_TOL)


def test_lora_trains_adapters_with_the_base_as_reference(tmp_path: Path, tok) -> None:
    from posttrain.peft import lora_state_dict

    cfg = load_config(GRPOConfig, None, rl_overrides(tmp_path, "lora", "lora.r=4", "kl.beta=0.1", "optim.lr=1e-2"))
    model = tiny_model(tok)
    embed = model.embed_tokens.weight.detach().clone()
    run = setup_run(cfg, "grpo", model=model, tokenizer=tok)
    assert run.reference is None  # no copy: the reference is the same module with the adapters off
    metrics = rl_step(run, 1)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the first update runs at the base weights
    assert torch.equal(embed, run.model.embed_tokens.weight)
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(run.model).items() if "lora_B" in k)
    assert rl_step(run, 2)["kl"] > 0


def test_ppo_value_loss_falls(tmp_path: Path, tok) -> None:
    extra = [
        "optim.lr=1e-6",
        "ppo.value_lr=3e-2",
        "train.epochs=2",
        "train.minibatch_size=4",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
    ]
    cfg = load_config(PPOConfig, None, rl_overrides(tmp_path, "ppo", *extra))
    run = setup_run(cfg, "ppo", model=tiny_model(tok), tokenizer=tok)
    losses = [rl_step(run, step)["loss/value"] for step in range(1, 6)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_train_grpo_end_to_end_writes_the_run(tmp_path: Path, tok) -> None:
    overrides = rl_overrides(tmp_path, "e2e", "train.max_steps=2", "data.eval_size=3")
    cfg = load_config(GRPOConfig, None, overrides)
    run_dir = train_grpo(cfg, model=tiny_model(tok), tokenizer=tok)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in (
        "reward/std",
        "zero_variance_frac",
        "entropy",
        "clip_frac/low",
        "clip_frac/high",
        "approx_kl",
        "response_len/mean",
        "response_len/max",
        "response_len/clipped_frac",
        "reward/unscorable",
        "tokens/rollout_per_s",
        "tokens/train_per_s",
        "time/rollout_s",
        "time/reward_s",
        "time/update_s",
        "memory/peak_rss_gb",
        "policy_version",
    ):
        assert key in steps[-1], key
    assert sum("eval/accuracy" in r for r in records) == 2  # before and after
    assert (run_dir / "final" / "config.json").is_file() and (run_dir / "summary.json").is_file()


def test_time_budget_starts_no_step_that_would_not_fit(tmp_path: Path, tok, monkeypatch, capsys) -> None:
    """A step is started only if it (as long as the slowest of the last three), the final evaluation and the
    save fit in train.max_minutes: after a first step reported to take 100 s, a 1-minute run stops there,
    still evaluates and saves, and says why."""
    import posttrain.trainers.rl.train as rl  # the loop calls rl_step by its name in this module

    real_step = rl.rl_step
    monkeypatch.setattr(rl, "rl_step", lambda run, step: {**real_step(run, step), "time/step_s": 100.0})
    overrides = rl_overrides(tmp_path, "budget", "train.max_steps=5", "train.max_minutes=1", "data.eval_size=2")
    run_dir = train_grpo(load_config(GRPOConfig, None, overrides), model=tiny_model(tok), tokenizer=tok)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 1]  # before, and after the last step
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    assert (run_dir / "final" / "config.json").is_file()
    assert "time budget of 1.0 min reached after 1 steps" in capsys.readouterr().out


def test_train_ppo_end_to_end_saves_the_value_head(tmp_path: Path, tok) -> None:
    overrides = rl_overrides(tmp_path, "ppo-e2e", "train.max_steps=1", "train.minibatch_size=4", "train.epochs=1")
    run_dir = train_ppo(load_config(PPOConfig, None, overrides), model=tiny_model(tok), tokenizer=tok)
    assert (run_dir / "final" / "value_head.safetensors").is_file()


# ----------------------------------------------------------------------------- bad input, before compute


def _fails_before_compute(monkeypatch, tmp_path: Path, overrides: list[str], match: str) -> None:
    import posttrain.models.hub as hub

    monkeypatch.setattr(hub, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    with pytest.raises(PosttrainError, match=match):
        train_grpo(load_config(GRPOConfig, None, overrides))
    assert not (tmp_path / "bad").exists(), "no run directory for a refused run"


def test_reward_with_wrong_signature_fails_first(monkeypatch, tmp_path: Path) -> None:
    bad = rl_overrides(tmp_path, "bad") + [f"reward.functions=[{reward_file(tmp_path)}:two_args]"]
    _fails_before_compute(monkeypatch, tmp_path, bad, "two_args")


def test_dataset_without_prompt_column_fails_first(monkeypatch, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(5)) + "\n")
    bad = rl_overrides(tmp_path, "bad", "data.task=null", f"data.path={data}")
    _fails_before_compute(monkeypatch, tmp_path, bad, "no prompt column 'prompt'")


@pytest.mark.parametrize(
    "options, match",
    [
        (["data.task_options.operation_weights=[1,2]"], "operation_weights must be 3 non-negative numbers"),
        (["data.task_options.colour=1"], "task 'word_problems'.*colour.*options: seed, operation_weights"),
    ],
)
def test_bad_task_options_fail_first(monkeypatch, tmp_path: Path, options: list[str], match: str) -> None:
    bad = rl_overrides(tmp_path, "bad", "data.task=word_problems", *options)
    _fails_before_compute(monkeypatch, tmp_path, bad, match)


def test_task_options_reach_the_task() -> None:
    from posttrain.rollout.prompts import make_prompt_source

    cfg = load_config(GRPOConfig, None, ["data.task=word_problems", "data.task_options.operation_weights=[0,0,1]"])
    assert {row["operations"] for row in make_prompt_source(cfg.data).sample(20)} == {4}


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=4", "train.minibatch_size=6"],
            "not a whole number of groups of rollout.samples_per_prompt=4",
        ),
        (
            ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=4", "train.minibatch_size=8"],
            "does not divide the rollout batch of 3 prompts x 4 samples = 12",
        ),
        (["train.minibatch_size=8", "train.micro_batch_size=12"], "micro_batch_size=12"),
        (["algorithm=ppo"], "algorithm 'ppo' is not one of"),
        (["loss.clip_eps_low=0.1", "loss.clip_eps_high=0.3"], "clips symmetrically"),
        (["data.task_options=[1]"], "data.task_options: expected a dict"),
        (["data.task=null", "data.path=x.jsonl", "data.task_options.k=1"], "task_options needs data.task"),
        (["data.task_options.seed=3"], "seed come from data.seed"),
    ],
)
def test_batch_shape_errors_name_the_keys(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(GRPOConfig, None, overrides)


def test_cli_reports_one_line_and_exit_status_2(capsys) -> None:
    assert cli_main(["grpo", "rollout.samples_per_prompt=3", "train.minibatch_size=4", "train.micro_batch_size=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "samples_per_prompt=3" in err[0]


def test_example_configs_load() -> None:
    cfg = load_config(GRPOConfig, ROOT / "examples" / "grpo_gsm8k.yaml")
    assert cfg.data.task == "gsm8k"
    assert load_config(GRPOConfig).algorithm == "grpo" and load_config(PPOConfig).ppo.lam == 0.95

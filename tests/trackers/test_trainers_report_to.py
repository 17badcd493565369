"""`log.report_to` through the trainers: an SFT run (the shared step loop, as DPO, RM and distillation use it)
and a GRPO run (the RL loop: an evaluation at step 0 and a second record at the last step) send W&B
(offline), Trackio (local) and MLflow (file store) every metric of metrics.jsonl, the run's name and the
config of config.yaml. A missing library stops every trainer at its config, with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main as cli_main
from posttrain.config import load_config
from posttrain.trackers.mlflow_tracker import mlflow_name
from posttrain.trainers.rl import train_grpo
from posttrain.trainers.rl.config import GRPOConfig
from posttrain.trainers.sft import SFTConfig, train_sft
from tests.data.tiny import save_tiny_model_dir, write_qa_jsonl
from tests.trackers.conftest import offline_env
from tests.trackers.readback import (
    assert_rows_hold,
    dotted,
    jsonl_by_step,
    jsonl_numbers,
    mlflow_numbers,
    mlflow_run,
    trackio_run,
    wandb_rows,
)
from tests.trainers import rl_helpers

ALL = "log.report_to=[wandb,trackio,mlflow]"


def _train_sft(root: Path, project: str) -> Path:
    model_dir = save_tiny_model_dir(root / "model")
    data = write_qa_jsonl(root / "qa.jsonl")
    cfg = load_config(
        SFTConfig,
        overrides=[
            f"model.name_or_path={model_dir}",
            f"data.path={data}",
            "data.columns={prompt: question, completion: answer}",
            "data.as_chat=true",
            "data.eval_fraction=0.25",
            "train.batch_size=2",
            "train.max_steps=3",
            "train.progress=false",
            f"out={root / 'sft-run'}",
            ALL,
            f"log.project={project}",
        ],
    )
    return train_sft(cfg)


def _train_grpo(root: Path, project: str) -> Path:
    tok = rl_helpers.tokenizer()
    cfg = load_config(
        GRPOConfig,
        None,
        [
            f"out={root / 'grpo-run'}",
            f"reward.functions=[{rl_helpers.reward_file(root)}:char_mix]",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "rollout.max_tokens=6",
            "data.eval_size=2",
            "train.max_steps=2",
            "log.progress=false",
            "save_final=false",
            ALL,
            f"log.project={project}",
        ],
    )
    return train_grpo(cfg, model=rl_helpers.tiny_model(tok), tokenizer=tok)


@pytest.fixture(scope="module", params=["sft", "grpo"])
def run(request, tmp_path_factory) -> tuple[Path, str]:
    """(the run directory, the tracker project) of one trainer's run with every tracker on."""
    root = tmp_path_factory.mktemp(request.param)
    project = f"posttrain-test-{root.name}"
    # One MLflow store for both runs' processes is what a user has; here each run's store is in its directory.
    out = root / f"{request.param}-run"
    with pytest.MonkeyPatch.context() as patch:
        for key, value in offline_env(root, f"file:{out / 'mlruns'}").items():
            patch.setenv(key, value)
        run_dir = (_train_sft if request.param == "sft" else _train_grpo)(root, project)
    assert run_dir == out
    return run_dir, project


def _config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_wandb_offline_gets_what_metrics_jsonl_gets(run):
    run_dir, project = run
    wandb_run, rows = wandb_rows(run_dir)
    assert wandb_run.name == run_dir.name and wandb_run.project == project
    assert wandb_run.config == _config(run_dir)
    assert_rows_hold(rows, jsonl_by_step(run_dir), "wandb")


def test_trackio_local_gets_what_metrics_jsonl_gets(run):
    run_dir, project = run
    trackio, rows = trackio_run(project, run_dir.name)
    assert {k: v for k, v in trackio.config.items() if not k.startswith("_")} == _config(run_dir)
    assert_rows_hold(rows, jsonl_by_step(run_dir), "trackio")


def test_mlflow_file_store_gets_what_metrics_jsonl_gets(run):
    run_dir, project = run
    mlflow, client = mlflow_run(f"file:{run_dir / 'mlruns'}", project, run_dir.name)
    assert mlflow.info.status == "FINISHED"
    # Names as a file store takes them: `loss/policy` as `loss.policy` beside `loss`, and the GRPO run's reward
    # metrics, which name the reward file's path (`reward//tmp/...`), without the empty path part.
    names = {key: mlflow_name(key, file_store=True) for key in jsonl_numbers(run_dir)}
    assert len(set(names.values())) == len(names)
    if "loss/policy" in names:
        assert names["loss/policy"] == "loss.policy"
    assert mlflow_numbers(client, mlflow) == {names[k]: v for k, v in jsonl_numbers(run_dir).items()}
    leaves = dotted(_config(run_dir))
    assert {
        mlflow_name(k, file_store=True): (v if isinstance(v, str) else json.dumps(v)) for k, v in leaves.items()
    } == mlflow.data.params


@pytest.mark.parametrize(
    "command, args",
    [
        ("sft", ["data.path=train.jsonl"]),
        ("dpo", ["data.path=pairs.jsonl"]),
        ("rm", ["data.path=pairs.jsonl"]),
        ("distill", ["data.path=train.jsonl", "teacher.name_or_path=teacher"]),
        ("grpo", []),
        ("ppo", []),
    ],
)
def test_a_missing_tracker_library_is_one_line_before_any_compute(command, args, tmp_path, monkeypatch, capsys):
    import posttrain.models.hub as hub

    monkeypatch.setattr(hub, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # None: `import wandb` fails, as when not installed
    out = tmp_path / "run"
    assert cli_main([command, *args, f"out={out}", "log.report_to=[mlflow, wandb]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: log.report_to includes 'wandb' but the wandb package is not installed: pip install 'posttrain[wandb]'"
    ]
    assert not out.exists()

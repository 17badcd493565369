"""`log.report_to`: how names are read, the registry that maps them to adapters, and what MetricsLogger
hands the trackers (the same records as metrics.jsonl; nothing left open when one cannot start)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.errors import ConfigError, PosttrainError
from posttrain.metrics import MetricsLogger, read_metrics
from posttrain.trackers import TRACKERS, registry, resolve_report_to
from posttrain.trackers.mlflow_tracker import mlflow_name
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from posttrain.trainers.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "value, names",
    [
        (None, []),
        ("none", []),
        ([], []),
        (["none"], []),
        ("wandb", ["wandb"]),
        (["mlflow", "wandb", "mlflow"], ["mlflow", "wandb"]),
    ],
)
def test_report_to_takes_a_list_one_name_or_none(value, names):
    assert resolve_report_to(value) == names


def test_the_tensorboard_switch_adds_tensorboard_once():
    assert resolve_report_to(["wandb"], tensorboard=True) == ["wandb", "tensorboard"]
    assert resolve_report_to(["tensorboard"], tensorboard=True) == ["tensorboard"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "log.report_to=wandbb",
            "log: report_to: unknown tracker 'wandbb' (one of: tensorboard, wandb, trackio, mlflow, or none)",
        ),
        ("log.report_to=[none, wandb]", "log: report_to: 'none' cannot be combined with other trackers"),
        ("log.project=' '", "log: project must not be empty"),
    ],
)
def test_bad_report_to_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(SFTConfig, None, ["data.path=x.jsonl", override])


@pytest.mark.parametrize("cls", [SFTConfig, GRPOConfig, PPOConfig])
def test_every_trainer_config_reads_report_to(cls):
    base = ["data.path=x.jsonl"] if cls is SFTConfig else []
    assert load_config(cls, None, base).log.trackers() == []
    assert load_config(cls, None, [*base, "log.report_to=mlflow"]).log.trackers() == ["mlflow"]
    cfg = load_config(cls, None, [*base, "log.report_to=[wandb, trackio]", "log.project=mine"])
    assert cfg.log.trackers() == ["wandb", "trackio"] and cfg.log.project == "mine"


def test_the_older_tensorboard_switch_is_checked_as_itself(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # None: `import tensorboard` fails
    with pytest.raises(
        ConfigError,
        match=r"^log.tensorboard is true but the tensorboard package is not installed: "
        r"pip install 'posttrain\[tensorboard\]'$",
    ):
        load_config(GRPOConfig, None, ["log.tensorboard=true"])


def test_every_tracker_has_its_extra_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, cls in TRACKERS.items():
        assert cls.extra in extras, f"{name}: no [{cls.extra}] extra in pyproject.toml"
    test_extra = " ".join(extras["test"])
    for needed in ("wandb", "trackio", "mlflow"):  # the offline tests of tests/trackers need the real libraries
        assert needed in test_extra, needed


def test_register_gives_an_adapter_its_name_for_the_package_and_extra_it_leaves_out(monkeypatch):
    monkeypatch.setattr(registry, "TRACKERS", {})  # register into a scratch registry

    @registry.register
    class Plain:
        name = "plain"

    @registry.register
    class Own:
        name, package, extra = "own", "own_module", "own-extra"

    assert (Plain.package, Plain.extra) == ("plain", "plain")
    assert (Own.package, Own.extra) == ("own_module", "own-extra")
    assert registry.TRACKERS == {"plain": Plain, "own": Own}
    assert [(cls.package, cls.extra) for cls in TRACKERS.values()] == [(name, name) for name in TRACKERS]


class FakeTracker:
    name, package, extra = "fake", "json", "fake"
    opened: list[FakeTracker] = []
    fail_open = False

    def __init__(self, project: str) -> None:
        self.project, self.logged, self.closed = project, [], False

    def open(self, run_name, config, run_dir) -> None:
        if type(self).fail_open:
            raise RuntimeError("no route to the server\nsecond line of the library's message")
        self.run_name, self.config, self.run_dir = run_name, config, run_dir
        FakeTracker.opened.append(self)

    def log(self, metrics, step) -> None:
        self.logged.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(TRACKERS, "fake", FakeTracker)
    FakeTracker.opened, FakeTracker.fail_open = [], False
    return FakeTracker


def test_trackers_get_each_record_as_metrics_jsonl_reads_it(tmp_path, fake):
    run_dir = tmp_path / "sft-20260101-000000"
    run_dir.mkdir()
    with MetricsLogger(run_dir, report_to="fake", config={"optim": {"lr": 1e-5}}, project="p") as logger:
        logger.log(1, {"loss": 2.5, "tokens": 3, "phase": "warmup", "flag": True})
        logger.log(2, {"loss": float("nan"), "grad_norm": math.inf})
    tracker = fake.opened[0]
    assert (tracker.run_name, tracker.project, tracker.config) == ("sft-20260101-000000", "p", {"optim": {"lr": 1e-5}})
    assert tracker.closed
    records = read_metrics(run_dir)
    assert [step for step, _ in tracker.logged] == [r["step"] for r in records] == [1, 2]
    for (_, sent), record in zip(tracker.logged, records):
        assert set(sent) == set(record) - {"step", "time"}
        assert all(sent[k] == record[k] or (math.isnan(sent[k]) and math.isnan(record[k])) for k in sent)
    assert isinstance(tracker.logged[1][1]["loss"], float) and tracker.logged[1][1]["grad_norm"] == math.inf


def test_a_tracker_that_cannot_start_is_one_line_and_leaves_nothing_open(tmp_path, fake, monkeypatch):
    class Second(FakeTracker):
        name = "second"

    monkeypatch.setitem(TRACKERS, "second", Second)
    Second.fail_open = True  # the first tracker opens, the second fails
    with pytest.raises(PosttrainError, match=r"^log.report_to: second could not start a run: no route to the server$"):
        MetricsLogger(tmp_path, report_to=["fake", "second"])
    assert len(fake.opened) == 1 and fake.opened[0].closed
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_missing_library_at_open_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(
        PosttrainError,
        match=r"^log.report_to includes 'mlflow' but the mlflow package is not "
        r"installed: pip install 'posttrain\[mlflow\]'$",
    ):
        MetricsLogger(tmp_path, report_to=["mlflow"])
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "key, store, file_store",
    [
        ("loss", "loss", "loss"),
        ("loss/policy", "loss/policy", "loss.policy"),
        ("reward//tmp/r.py:f/mean", "reward/tmp/r.py:f/mean", "reward.tmp.r.py:f.mean"),
        ("weights.a*b", "weights.a_b", "weights.a_b"),
        ("/./", "_", "_"),
    ],
)
def test_mlflow_names(key, store, file_store):
    assert mlflow_name(key) == store and mlflow_name(key, file_store=True) == file_store

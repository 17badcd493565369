"""Tiny preference data and a tiny model directory for the DPO / reward-model / distillation tests."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.config import load_config
from tests.data.tiny import save_tiny_model_dir

PAIRS = [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 1), (8, 2)]


def pair_rows() -> list[dict]:
    return [
        {"prompt": f"What is {a} plus {b}?", "chosen": f" The answer is {a + b}.", "rejected": f" The sky is blue {a}."}
        for a, b in PAIRS
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def setup_dir(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    """(model dir, pairs.jsonl)"""
    model = save_tiny_model_dir(tmp_path / "model", seed=seed)
    return model, write_jsonl(tmp_path / "pairs.jsonl", pair_rows())


def config(cls, model: Path, data: Path, out: Path, *overrides: str):
    return load_config(
        cls,
        overrides=[
            f"model.name_or_path={model}",
            f"data.path={data}",
            f"out={out}",
            "train.progress=false",
            *overrides,
        ],
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

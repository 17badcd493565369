"""The A-versus-B benchmarks' settings: both sides at the same precision, the arguments they refuse, and the
figures their JSON lines derive (baseline names, decode rates, fractions of the roofs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import grpo_step  # noqa: E402
import matching  # noqa: E402
import quant  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402


def test_precision_maps_to_posttrain_model_dtype() -> None:
    assert matching.posttrain_model_dtype("fp32") == "float32"
    assert matching.posttrain_model_dtype("bf16") == "auto"  # autocast over fp32 weights, as TRL's bf16=True
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        matching.posttrain_model_dtype("fp16")


def test_bf16_pairing_refused_where_posttrain_would_compute_fp32() -> None:
    matching.require_bf16_autocast("bf16", torch.bfloat16)
    matching.require_bf16_autocast("fp32", None)
    with pytest.raises(SystemExit, match="computes in float32 on this CPU"):
        matching.require_bf16_autocast("bf16", None)


def test_update_autocast_reads_the_runs_autocast() -> None:
    from types import SimpleNamespace

    def run(autocast):
        return SimpleNamespace(parallel=SimpleNamespace(compute_autocast=autocast))

    assert matching.update_autocast(run(("cpu", torch.bfloat16))) == torch.bfloat16
    assert matching.update_autocast(run(None)) is None  # computes in the weights' dtype


def test_side_names_compute_threads_checkpointing_and_versions() -> None:
    entry = matching.side("float32", 2, ("transformers", "trl"))
    assert entry["compute"] == "float32" and entry["threads"] == 2 and entry["gradient_checkpointing"] is False
    assert "torch" in entry["versions"] and set(entry["versions"]) <= {"torch", "transformers", "trl"}
    assert "posttrain" in matching.side("float32", 1)["versions"]


def test_training_benchmarks_default_to_fp32_on_both_sides() -> None:
    assert sft.parse_args([]).precision == "fp32"
    assert sft.parse_args(["--precision", "bf16"]).precision == "bf16"
    assert grpo_step.build_parser().parse_args([]).precision == "fp32"
    with pytest.raises(SystemExit):
        sft.parse_args(["--steps", "1"])  # each side must go first at least once
    with pytest.raises(SystemExit):
        grpo_step.build_parser().parse_args(["--precision", "fp16"])


def test_quant_baseline_is_named_for_what_it_computes() -> None:
    assert quant.baseline_name("float32") == "fp32"
    assert quant.baseline_name("bfloat16") == "fp32 weights, bfloat16 compute"
    assert quant.build_parser().parse_args([]).compute_dtype == "float32"
    # 4 prompts x 9 tokens after the first, in the 0.5 s they added to the 1-token run
    assert quant.decode_rate(4, 10, 0.25, 0.75) == pytest.approx(72.0)
    with pytest.raises(SystemExit):
        quant.main(["--rounds", "1"])


def test_rollout_precision_pairs_the_sides() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert rollout.precision_dtypes("fp32", cpu) == (torch.float32, "float32", torch.float32)
    # CPU: bf16 compute over the trainer's fp32 weights; transformers in bf16
    assert rollout.precision_dtypes("bf16", cpu) == (torch.float32, "bfloat16", torch.bfloat16)
    assert rollout.precision_dtypes("bf16", cuda) == (torch.bfloat16, "bfloat16", torch.bfloat16)
    with pytest.raises(SystemExit):
        rollout.main(["--rounds", "1"])


def test_rollout_roof_fractions() -> None:
    roof = {"bandwidth_gbs": 20.0, "matmul_gflops": {"float32": 100.0, "bfloat16": 400.0}}
    # 1e9 parameters x 2 bytes x 5 tokens/s = 10 GB/s of a 20 GB/s roof; 200 of 400 bf16 GFLOP/s
    fractions = rollout.roof_fractions(5.0, 10**9, "bfloat16", 200.0, roof)
    assert fractions == {
        "batch1_weight_bytes": 2 * 10**9,
        "batch1_streamed_gbs": 10.0,
        "batch1_of_bandwidth": 0.5,
        "batched_of_matmul": 0.5,
    }
    no_bandwidth = rollout.roof_fractions(5.0, 10**9, "float32", 50.0, {"matmul_gflops": roof["matmul_gflops"]})
    assert no_bandwidth == {"batch1_weight_bytes": 4 * 10**9, "batched_of_matmul": 0.5}

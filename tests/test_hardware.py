"""posttrain.hardware: the CPU's features (read or forced), the cached matmul probe, and what `auto` picks."""

from __future__ import annotations

import json

import pytest

from posttrain import hardware
from posttrain.cli import main
from tests.data.tiny import save_tiny_model_dir

AVX2 = "avx avx2 fma"
ZEN5 = "avx2,fma,avx512f,avx512_bf16,avx512_vnni"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.FEATURES_ENV, raising=False)


def no_probe() -> dict[str, float]:
    raise AssertionError("the matmul probe ran")


def test_forced_features_replace_the_cpus(monkeypatch):
    monkeypatch.setenv(hardware.FEATURES_ENV, ZEN5)
    features = hardware.cpu_features()
    assert features.forced and features.fast_bf16 and features.int8_dot
    assert features.shown_flags() == ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]
    monkeypatch.setenv(hardware.FEATURES_ENV, AVX2)
    features = hardware.cpu_features()
    assert features.forced and not features.fast_bf16 and not features.int8_dot


def test_amx_counts_as_fast_bf16_and_int8(monkeypatch):
    monkeypatch.setenv(hardware.FEATURES_ENV, "amx_tile amx_bf16 amx_int8")
    features = hardware.cpu_features()
    assert features.fast_bf16 and features.int8_dot


def test_auto_is_fp32_without_fast_bf16_and_never_probes_for_it(monkeypatch):
    monkeypatch.setattr(hardware, "_measure", no_probe)
    monkeypatch.setenv(hardware.FEATURES_ENV, AVX2)
    choice = hardware.auto_dtype("cpu")
    assert choice.dtype == "float32" and "no fast bf16" in choice.reason and hardware.FEATURES_ENV in choice.reason


def test_auto_is_bf16_on_a_forced_fast_bf16_cpu_and_on_gpus(monkeypatch):
    monkeypatch.setattr(hardware, "_measure", no_probe)  # a forced feature set is believed as given
    monkeypatch.setenv(hardware.FEATURES_ENV, ZEN5)
    assert hardware.auto_dtype("cpu").dtype == "bfloat16"
    monkeypatch.setenv(hardware.FEATURES_ENV, AVX2)
    assert hardware.auto_dtype("cuda").dtype == "bfloat16"


def test_auto_checks_the_measured_rates_of_a_real_fast_bf16_cpu(monkeypatch):
    """bf16 flags whose matmul measures slower than fp32 (an ISA held back by MKL / oneDNN settings): fp32."""
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Zen 5", frozenset(ZEN5.split(","))))
    monkeypatch.setattr(hardware, "_measure", lambda: {"float32": 100.0, "bfloat16": 20.0})
    choice = hardware.auto_dtype("cpu")
    assert choice.dtype == "float32" and "measured 20.0" in choice.reason
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Zen 5 (another)", frozenset(ZEN5.split(","))))
    monkeypatch.setattr(hardware, "_measure", lambda: {"float32": 100.0, "bfloat16": 430.0})
    choice = hardware.auto_dtype("cpu")
    assert choice.dtype == "bfloat16" and "4.3x fp32" in choice.reason


def test_the_probe_runs_once_then_reads_the_cache(monkeypatch):
    calls = []
    real = hardware._measure

    def counted() -> dict[str, float]:
        calls.append(1)
        return real()

    monkeypatch.setattr(hardware, "_measure", counted)
    monkeypatch.setattr(hardware, "PROBE_SECONDS", 0.005)
    # Flags without fast bf16: whatever the real rates (a loaded machine, oneDNN capped at AVX2), nothing here
    # contradicts them, so the caching rule alone is under test (the contradiction rule has its own test below).
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("an AVX2 CPU", frozenset({"avx2", "fma"})))
    first = hardware.matmul_rates()
    assert first["float32"] > 0 and first["bfloat16"] > 0
    assert hardware.matmul_rates() == first and len(calls) == 1


def test_a_probe_that_contradicts_fast_bf16_flags_is_not_cached(monkeypatch):
    """Fast bf16 flags but bf16 no faster than fp32 (a probe taken while a compile held the cores): believed for
    this process, measured again by the next, so one bad minute cannot pin `auto` to fp32 for good."""
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Zen 5 (busy)", frozenset(ZEN5.split(","))))
    measured = iter([{"float32": 73.0, "bfloat16": 4.2}, {"float32": 190.0, "bfloat16": 900.0}])
    monkeypatch.setattr(hardware, "_measure", lambda: next(measured))
    assert hardware.matmul_rates() == {"float32": 73.0, "bfloat16": 4.2}
    assert hardware.auto_dtype("cpu").dtype == "bfloat16"  # the second probe, now cached
    monkeypatch.setattr(hardware, "_measure", no_probe)
    assert hardware.matmul_rates() == {"float32": 190.0, "bfloat16": 900.0}


def test_each_dtype_keeps_its_best_round(monkeypatch):
    """The dtypes take turns over PROBE_ROUNDS rounds; a round slowed by other work does not lower the rate."""
    rounds = iter([10.0, 3.0, 5.0, 40.0, 1.0, 6.0, 20.0, 2.0, 4.0])  # fp32, bf16, int8 per round
    monkeypatch.setattr(hardware, "PROBE_ROUNDS", 3)
    monkeypatch.setattr(hardware, "_rate", lambda call, flops: next(rounds))
    assert hardware._measure() == {"float32": 40.0, "bfloat16": 3.0, "int8": 6.0}


def test_info_shows_the_cpu_and_what_auto_picks(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(hardware.FEATURES_ENV, AVX2)
    monkeypatch.setattr(hardware, "_measure", lambda: {"float32": 30.0, "bfloat16": 0.8, "int8": 1.1})
    model_dir = save_tiny_model_dir(tmp_path / "model")
    assert main(["info", "--json", "--model", str(model_dir)]) == 0
    cpu = json.loads(capsys.readouterr().out)["cpu"]
    assert cpu["flags"] == ["avx2", "fma"] and cpu["flags_forced"] is True
    assert (cpu["fast_bf16"], cpu["int8_dot"]) == (False, False)
    assert cpu["matmul_gflops"] == {"float32": 30.0, "bfloat16": 0.8, "int8": 1.1}
    assert cpu["auto_dtype"] == "float32" and "fp32 is the fast path" in cpu["auto_dtype_reason"]
    assert main(["info", "--model", str(model_dir)]) == 0
    text = capsys.readouterr().out
    assert "cpu.auto_dtype" in text and "float32 30, bfloat16 0.8, int8 1.1" in text

"""benchmarks/vs_llamacpp.py without llama.cpp: its dry run prints the plan, llama-batched-bench's table parses,
bad arguments get one clear line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_llamacpp.py"

# llama-batched-bench's table (as printed by the build the script drives), -npl 1,16 -pps.
TABLE = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    95 |     32 |    1 |    127 |    0.210 |   452.38 |    0.410 |    78.05 |    0.620 |   204.84 |
|    95 |     32 |   16 |    607 |    0.211 |   450.24 |    0.890 |   575.28 |    1.101 |   551.32 |
"""


def _module(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "vs_llamacpp", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_plan():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--quick"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["threads"] == 2 and report["workload"] == {"prompts": 4, "n": 4, "max_tokens": 32}
    command = report["commands"]["q8_0"]
    assert command[0].endswith("bin/llama-batched-bench") and "LLAMACPP/smollm2-q8_0.gguf" in command
    assert command[command.index("-npl") + 1] == "1,16" and "-pps" in command
    assert command[command.index("-t") + 1] == command[command.index("-tb") + 1] == "2"
    assert set(report["commands"]) == {"f32", "bf16", "q8_0"}


def test_parses_the_batched_bench_table(monkeypatch: pytest.MonkeyPatch):
    assert _module(monkeypatch).parse_batched_bench(TABLE) == {1: 78.05, 16: 575.28}


def test_decode_rate_leaves_out_the_prefill_and_the_first_token(monkeypatch: pytest.MonkeyPatch):
    """As S_TG: a fake engine whose runs cost 5 s of prefill plus 0.5 s a token decodes at 2 tokens/s, however
    long the prefill; each run starts from an empty prefix cache."""
    from posttrain.engine import SamplingParams

    module = _module(monkeypatch)
    clock, cleared = [0.0], []

    class FakeLLM:
        engine = SimpleNamespace(weights_updated=lambda: cleared.append(clock[0]))

        def generate(self, prompts: list, params: SamplingParams) -> list:
            clock[0] += 5.0 + 0.5 * len(prompts) * params.n * params.max_tokens
            sample = SimpleNamespace(token_ids=[7] * params.max_tokens)
            return [SimpleNamespace(outputs=[sample] * params.n) for _ in prompts]

    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    rate, outputs = module.decode_rate(FakeLLM(), [[1], [2]], SamplingParams(n=2, max_tokens=9))
    assert rate == pytest.approx(2.0)  # (36 - 4) tokens in (23 - 7) s
    assert len(outputs) == 2 and len(outputs[0].outputs[0].token_ids) == 9  # the full run's outputs
    assert len(cleared) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precisions", "f16"], "--precisions: f16"),
        (["--dry-run", "--threads", "0"], "--threads=0"),
        (["--dry-run", "--rounds", "0"], "--rounds=0"),
        ([], "--llamacpp DIR is needed"),
        (["--llamacpp", "/nonexistent"], "no bin/llama-batched-bench"),
    ],
)
def test_bad_arguments_get_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    with pytest.raises(SystemExit):
        _module(monkeypatch).parse_args(argv)
    assert message in capsys.readouterr().err


def test_rounds_report_medians_and_the_median_of_each_rounds_ratio(monkeypatch: pytest.MonkeyPatch):
    """Three rounds in which the machine's speed moved: both sides slowed in round 2. The ratio is the median of
    the rounds' own ratios (1.0), not the ratio of the medians (0.9); flags hold only if they held every round."""
    summarize = _module(monkeypatch).summarize
    theirs = [{"batched": 100.0, "batch1": 100.0}, {"batched": 50.0, "batch1": 50.0}, {"batched": 90.0, "batch1": 80.0}]
    ours = [
        {
            "batched": 110.0,
            "batch1": 100.0,
            "dtype": "bfloat16",
            "batch1_speculative": 120.0,
            "speculative_identical": True,
        },
        {
            "batched": 60.0,
            "batch1": 45.0,
            "dtype": "bfloat16",
            "batch1_speculative": 60.0,
            "speculative_identical": False,
        },
        {
            "batched": 99.0,
            "batch1": 80.0,
            "dtype": "bfloat16",
            "batch1_speculative": 90.0,
            "speculative_identical": True,
        },
    ]
    report = summarize(list(zip(theirs, ours)))
    assert report["llamacpp"] == {"batched": 90.0, "batch1": 80.0}
    assert report["posttrain"]["batch1"] == 80.0 and report["posttrain"]["dtype"] == "bfloat16"
    assert report["posttrain"]["speculative_identical"] is False
    assert report["batch1_ratio"] == 1.0  # rounds: 1.0, 0.9, 1.0
    assert report["batched_ratio"] == 1.1  # rounds: 1.1, 1.2, 1.1
    assert report["batch1_speculative_ratio"] == 1.2  # rounds: 1.2, 1.2, 1.125
    assert [r["batch1_ratio"] for r in report["rounds"]] == [1.0, 0.9, 1.0]


def test_one_round_reports_as_before(monkeypatch: pytest.MonkeyPatch):
    report = _module(monkeypatch).summarize([({"batched": 300.0, "batch1": 90.0}, {"batched": 330.0, "batch1": 99.0})])
    assert report == {
        "llamacpp": {"batched": 300.0, "batch1": 90.0},
        "posttrain": {"batched": 330.0, "batch1": 99.0},
        "batched_ratio": 1.1,
        "batch1_ratio": 1.1,
    }


def test_a_failed_conversion_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The converter's last line of stderr (here, a module it cannot import) in one error naming the HF dir and the
    GGUF, not a CalledProcessError traceback."""
    module = _module(monkeypatch)
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        "import sys\nprint('Traceback ...', file=sys.stderr)\n"
        "print(\"ModuleNotFoundError: No module named 'conversion'\", file=sys.stderr)\nsys.exit(1)\n"
    )
    with pytest.raises(SystemExit) as exited:
        module.convert(tmp_path, tmp_path / "hf", "q8_0")
    message = str(exited.value)
    assert message.startswith(f"error: converting {tmp_path / 'hf'} to {tmp_path / 'smollm2-q8_0.gguf'} failed (1): ")
    assert "No module named 'conversion'" in message and "\n" not in message

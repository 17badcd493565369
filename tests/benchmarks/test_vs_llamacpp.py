"""benchmarks/vs_llamacpp.py and benchmarks/llamacpp_cli.py without llama.cpp: the plan's commands, the tools'
output as this build prints it, the settings search, medians and ratios, roofs, bad arguments in one line."""

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

# llama-batched-bench --output-format jsonl (llama-cpp-python 0.3.36's build), two runs among its log lines.
BATCHED_JSONL = """main: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 1
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 1, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 95, "tg": 8, "pl": 1, "n_kv": 103, "t_pp": 0.66, "speed_pp": 143.9, \
"t_tg": 0.2078, "speed_tg": 38.494110, "t": 0.86, "speed": 118.68}
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 1, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 95, "tg": 8, "pl": 4, "n_kv": 412, "t_pp": 0.49, "speed_pp": 191.4, \
"t_tg": 0.902032, "speed_tg": 35.475460, "t": 1.398152, "speed": 90.834190}
llama_perf_context_print: load time = 100 ms
"""


def llama_bench_record(fa: int, repack: bool, strict: bool, ts: float, n_gen: int = 16) -> dict:
    """One record of `llama-bench -o json` as this build prints it (the fields the parser reads, and a few more)."""
    return {
        "build_commit": "0c1e570",
        "build_number": 1,
        "model_size": 143025408,
        "model_n_params": 134515008,
        "n_threads": 2,
        "cpu_strict": strict,
        "poll": 50,
        "type_k": "f16",
        "type_v": "f16",
        "flash_attn": fa,
        "repack": repack,
        "n_prompt": 0,
        "n_gen": n_gen,
        "n_depth": 95,
        "avg_ts": ts,
        "stddev_ts": 1.5,
        "samples_ts": [ts - 1.5, ts + 1.5],
    }


def _module(monkeypatch: pytest.MonkeyPatch, name: str = "vs_llamacpp"):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_matched_commands():
    """Without fast bf16 (the AVX2 path the tests force) every row's KV is f32, so batch 1 comes from
    llama-batched-bench's repeated one-sequence runs (llama-bench refuses f32 KV); shared and distinct differ
    only by -pps and the context they need."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--quick"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["threads"] == 2 and report["workload"] == {"sequences": 16, "max_tokens": 32, "repetitions": 2}
    assert set(report["commands"]) == {"f32", "bf16", "q8_0"}
    q8 = report["commands"]["q8_0"]
    shared, distinct, batch1 = q8["shared"], q8["distinct"], q8["batch1"]
    assert shared[0].endswith("bin/llama-batched-bench") and "LLAMACPP/smollm2-q8_0.gguf" in shared
    assert "-pps" in shared and "-pps" not in distinct
    assert shared[shared.index("-npl") + 1] == "16" and shared[shared.index("-ctk") + 1] == "f32"
    assert int(distinct[distinct.index("-c") + 1]) >= 16 * (95 + 32) > int(shared[shared.index("-c") + 1])
    assert batch1[batch1.index("-npl") + 1] == "1,1,1" and batch1[batch1.index("-ntg") + 1] == "32"
    assert shared[shared.index("-t") + 1] == shared[shared.index("-tb") + 1] == "2"
    assert len(q8["tuning"]["batch1_grid"]) == 8


def test_batch1_uses_llama_bench_where_it_takes_the_kv_type(monkeypatch: pytest.MonkeyPatch):
    module = _module(monkeypatch)
    args = module.parse_args(["--dry-run"])
    command = module.batch1_plan(Path("L"), Path("L/m.gguf"), args, module.LlamaSettings(kv_type="bf16"))
    assert command[0] == "L/bin/llama-bench"
    assert command[command.index("-n") + 1] == "128" and command[command.index("-r") + 1] == "5"
    assert command[command.index("-d") + 1] == "95" and command[command.index("-p") + 1] == "0"
    assert command[command.index("-ctk") + 1] == command[command.index("-ctv") + 1] == "bf16"


def test_parses_batched_bench_json_lines(monkeypatch: pytest.MonkeyPatch):
    cli = _module(monkeypatch, "llamacpp_cli")
    assert cli.parse_batched_bench(BATCHED_JSONL) == [(1, 38.49411), (4, 35.47546)]


def test_parses_llama_bench_records_with_their_settings(monkeypatch: pytest.MonkeyPatch):
    cli = _module(monkeypatch, "llamacpp_cli")
    output = json.dumps([llama_bench_record(1, False, True, 120.0), llama_bench_record(0, True, False, 99.0, n_gen=0)])
    (record,) = cli.parse_llama_bench(output)  # the prompt-processing record (n_gen 0) is left out
    assert record["settings"] == {
        "kv_type": "f16",
        "flash_attn": "on",
        "repack": False,
        "cpu_strict": True,
        "kv_unified": False,
    }
    assert record["mean"] == 120.0 and record["stddev"] == 1.5 and record["samples"] == [118.5, 121.5]
    assert record["build"] == "0c1e570 (1)"


def test_llama_bench_crosses_the_grid_once(monkeypatch: pytest.MonkeyPatch):
    """llama-bench crosses its list flags itself: each value once, in order, so the 8 settings are 8 runs."""
    cli = _module(monkeypatch, "llamacpp_cli")
    grid = cli.settings_grid("f16", batched=False)
    assert len(grid) == 8 and len(set(grid)) == 8
    command = cli.llama_bench_command(
        Path("L"), Path("m.gguf"), max_tokens=64, depth=95, repetitions=3, threads=2, grid=grid
    )
    flags = {command[i]: command[i + 1] for i in range(1, len(command) - 1) if command[i].startswith("-")}
    assert flags["-fa"] == "off,on" and flags["--repack"] == "1,0" and flags["--cpu-strict"] == "0,1"
    assert flags["-ctk"] == "f16" and flags["-r"] == "3"
    assert len(cli.settings_grid("f32", batched=True)) == 16


def test_settings_flags_and_bad_values(monkeypatch: pytest.MonkeyPatch):
    cli = _module(monkeypatch, "llamacpp_cli")
    flags = cli.LlamaSettings("bf16", "on", repack=False, cpu_strict=True, kv_unified=True).batched_flags()
    assert flags == ["-ctk", "bf16", "-ctv", "bf16", "-fa", "on", "--no-repack", "--cpu-strict", "1", "-kvu"]
    assert cli.LlamaSettings().batched_flags() == ["-ctk", "f16", "-ctv", "f16", "-fa", "off"]
    with pytest.raises(ValueError, match="kv_type 'f8'"):
        cli.LlamaSettings(kv_type="f8")
    with pytest.raises(ValueError, match="flash_attn 'auto'"):
        cli.LlamaSettings(flash_attn="auto")


def test_tuning_keeps_the_fastest_settings_per_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A fake llama.cpp in which flash attention helps batch 1 and the shared prompt, a unified buffer helps only
    the shared prompt, and strict pinning helps batch 1: each workload keeps its own fastest, and the matched KV
    type (f32, which llama-bench refuses) is kept for the measured runs though batch 1's grid ran at f16."""
    module = _module(monkeypatch)
    side = module.LlamaCppSide(tmp_path, "f32", 2)
    kvs = []

    def bench(workload, grid):  # noqa: ANN001, ANN202
        kvs.extend(s.kv_type for s in grid)
        speed = {s: 100 + 10 * (s.flash_attn == "on") + 5 * s.cpu_strict - 3 * s.repack for s in grid}
        return [{"settings": vars(s), "mean": v, "build": "b"} for s, v in speed.items()]

    def batched(workload, shared, settings):  # noqa: ANN001, ANN202
        fa = settings.flash_attn == "on"
        if shared:
            return 300 + 20 * settings.kv_unified + 10 * fa
        return 300 - 5 * fa

    monkeypatch.setattr(side, "bench", bench)
    monkeypatch.setattr(side, "batched", batched)
    best, table = side.tune("f32")
    assert set(kvs) == {"f16"}
    assert best["batch1"] == module.LlamaSettings("f32", "on", repack=False, cpu_strict=True)
    assert best["shared"] == module.LlamaSettings("f32", "on", repack=False, cpu_strict=True, kv_unified=True)
    assert best["distinct"] == module.LlamaSettings("f32", "off", repack=False, cpu_strict=True)
    assert len(table["batch1"]) == 8 and len(table["shared"]) == 4 and len(table["distinct"]) == 2


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


def test_prompts_are_distinct_and_exactly_the_length(monkeypatch: pytest.MonkeyPatch):
    module = _module(monkeypatch)

    class Tokenizer:  # 40 tokens a question, numbered so windows can be told apart
        count = 0

        def apply_chat_template(self, messages: list, **_: object) -> list[int]:
            Tokenizer.count += 1
            return list(range(Tokenizer.count * 1000, Tokenizer.count * 1000 + 40))

    prompts = module.fixed_prompts(Tokenizer(), 5, length=95)
    assert [len(p) for p in prompts] == [95] * 5
    assert len({tuple(p) for p in prompts}) == 5 and Tokenizer.count == 12  # 5 x 95 = 475 <= 12 x 40


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precisions", "f16"], "--precisions: f16"),
        (["--dry-run", "--threads", "0"], "--threads=0"),
        (["--dry-run", "--rounds", "0"], "--rounds=0"),
        (["--dry-run", "--sequences", "300"], "--sequences=300: llama.cpp runs at most 256"),
        (["--dry-run", "--max-tokens", "-1"], "--max-tokens=-1"),
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
    """Three rounds in which the machine's speed moved (both sides slowed in round 2): each ratio is the median
    of the rounds' own ratios, not the ratio of the medians; batch 1's stddevs are kept per round."""
    summarize = _module(monkeypatch).summarize

    def figures(shared: float, distinct: float, batch1: float) -> dict:
        return {"shared": shared, "distinct": distinct, "batch1": batch1, "batch1_stddev": batch1 / 100}

    theirs = [figures(100, 100, 100), figures(50, 50, 50), figures(90, 90, 80)]
    ours = [figures(110, 100, 100), figures(60, 50, 45), figures(99, 90, 80)]
    report = summarize(list(zip(theirs, ours)))
    assert report["batch1"]["llamacpp"] == 80 and report["batch1"]["posttrain"] == 80
    assert report["batch1"]["ratio"] == 1.0 and report["batch1"]["ratio_min"] == 0.9  # rounds 1.0, 0.9, 1.0
    assert report["shared"]["ratio"] == 1.1 and report["shared"]["ratio_max"] == 1.2  # rounds 1.1, 1.2, 1.1
    assert report["distinct"]["posttrain_rounds"] == [100, 50, 90]
    assert report["batch1"]["llamacpp_stddev"] == [1.0, 0.5, 0.8]


def test_roof_fractions(monkeypatch: pytest.MonkeyPatch):
    """Batch 1 at 50 tokens/s streaming 200 MB a token is 10 GB/s: a quarter of a 40 GB/s roof; 1000 tokens/s at
    2 x 100 M FLOPs a token is 200 GFLOP/s: half of a 400 GFLOP/s matmul."""
    module = _module(monkeypatch)
    side = {"batch1": 50.0, "shared": 1000.0, "distinct": 500.0}
    report = {w: {"posttrain": side[w], "llamacpp": side[w] / 2} for w in side}
    roofs = {"bandwidth_gbs": 40.0, "matmul_gflops": {"float32": 400.0, "bfloat16": 1600.0}}
    out = module.roof_fractions(report, roofs, weight_bytes=200_000_000, parameters=100_000_000, compute="float32")
    assert out["posttrain"] == {"batch1_of_bandwidth": 0.25, "shared_of_matmul": 0.5, "distinct_of_matmul": 0.25}
    assert out["llamacpp"]["batch1_of_bandwidth"] == 0.125


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


def test_version_info_names_a_build_without_a_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    cli = _module(monkeypatch, "llamacpp_cli")
    assert "llamacpp_version.json is missing" in cli.version_info(tmp_path)["unknown"]
    (tmp_path / "llamacpp_version.json").write_text('{"llama_cpp_python": "0.3.36", "ggml": "0.25.3"}')
    assert cli.version_info(tmp_path) == {"llama_cpp_python": "0.3.36", "ggml": "0.25.3"}

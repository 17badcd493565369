"""LoRA training step, posttrain vs peft: forward + backward time and peak memory, one JSON line.

    .venv/bin/python benchmarks/lora.py                      # default model, batch 8 x 256 tokens, r=16, all-linear
    .venv/bin/python benchmarks/lora.py --batch 2 --seq-len 64 --steps 2   # a quick look

Each side runs in its own process (so peak RSS is its own) on the same weights, the same token ids and the
same adapter values (A and B set from one seeded generator per module name, B non-zero so the adapter path
does real work); dropout 0, fp32. A step is: forward, next-token cross-entropy, backward (no optimizer step:
both would run the same AdamW over the same adapter tensors). The parent process interleaves the steps,
ours / peft / peft / ours / ..., so load from other processes on a shared machine falls on both sides alike.
The losses and gradient norms of the two sides must agree, which checks that both computed the same step.
Memory: peak resident set size sampled every 2 ms during the steps, minus the resident size just before
them (weights, adapters and inputs already in place).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size in a background thread; `.peak` is the largest value seen."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.peak, self._stop = interval_s, rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def adapter_values(
    hf_module_name: str, r: int, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (A, B) for a module on both sides, from a generator seeded by its HF name."""
    gen = torch.Generator().manual_seed(zlib.crc32(hf_module_name.encode()))
    A = (torch.rand(r, in_features, generator=gen) * 2 - 1) / in_features**0.5
    B = torch.randn(out_features, r, generator=gen) * 0.01
    return A, B


def build_ours(model_path: Path, r: int, alpha: float):
    from posttrain.models.checkpoint_io import load_hf_dir
    from posttrain.peft import LoraConfig, apply_lora, lora_layers
    from posttrain.peft.lora import hf_module_name

    model = load_hf_dir(model_path, dtype=torch.float32)
    apply_lora(model, LoraConfig(r=r, alpha=alpha, dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            A, B = adapter_values(hf_module_name(name), r, layer.in_features, layer.out_features)
            layer.lora_A["default"].weight.copy_(A)
            layer.lora_B["default"].weight.copy_(B)
    return model, (lambda ids: model(ids))


def build_peft(model_path: Path, r: int, alpha: float):
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model = peft.get_peft_model(
        hf, peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                hf_name = name.removeprefix("base_model.model.")
                A, B = adapter_values(hf_name, r, module.in_features, module.out_features)
                module.lora_A["default"].weight.copy_(A)
                module.lora_B["default"].weight.copy_(B)
    return model, (lambda ids: model(input_ids=ids, use_cache=False).logits)


def worker(args: argparse.Namespace) -> None:
    """Set up one side, print `ready`, answer each `step` line with one JSON line; `finish` ends it."""
    torch.set_num_threads(args.threads)
    from posttrain.models.hub import resolve_model_path

    build = build_ours if args.worker == "ours" else build_peft
    model, logits_of = build(resolve_model_path(args.model), args.r, 2.0 * args.r)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        for p in trainable:
            p.grad = None
        logits = logits_of(ids)  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.item()

    with torch.no_grad():  # page in every weight (safetensors maps files lazily) so RSS counts them before the steps
        for t in list(model.parameters()) + list(model.buffers()):
            t.sum()
    rss_before = rss_bytes()
    print("ready", flush=True)
    with PeakRSS() as peak:
        for line in sys.stdin:
            if line.strip() != "step":
                break
            t0 = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - t0
            release_free_memory()  # the idle side should not sit on freed heap while the other side steps
            print(json.dumps({"step_s": elapsed, "loss": loss}), flush=True)
    grads = [p.grad.norm() for p in trainable if p.grad is not None]
    grad_norm = torch.linalg.vector_norm(torch.stack(grads)).item() if grads else float("nan")
    print(
        json.dumps(
            {
                "step_peak_rss_mib": round((peak.peak - rss_before) / 2**20, 1),
                "process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "rss_before_steps_mib": round(rss_before / 2**20, 1),
                "trainable_parameters": sum(p.numel() for p in trainable),
                "adapter_grad_norm": grad_norm,
            }
        ),
        flush=True,
    )


class Side:
    """One worker process, driven line by line from the parent."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.times, self.losses = name, [], []
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq-len",
            str(args.seq_len),
            "--r",
            str(args.r),
            "--threads",
            str(args.threads),
        ]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"{self.name} worker died (exit status {self.proc.wait()})")
        return line.strip()

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def step(self, timed: bool) -> None:
        self.send("step")
        result = json.loads(self.read())
        self.losses.append(result["loss"])
        if timed:
            self.times.append(result["step_s"])

    def finish(self) -> dict:
        self.send("finish")
        summary = json.loads(self.read())
        self.proc.wait()
        return {
            "step_s": round(statistics.median(self.times), 3),
            "step_s_all": [round(t, 3) for t in self.times],
            "loss": self.losses[-1],
            **summary,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--worker", choices=["ours", "peft"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sides = [Side("ours", args), Side("peft", args)]
    for side in sides:
        if side.read() != "ready":
            sys.exit(f"{side.name} worker did not start")
    for i in range(args.warmup + args.steps):  # interleaved, alternating who goes first
        for side in sides if i % 2 == 0 else sides[::-1]:
            side.step(timed=i >= args.warmup)
    ours, theirs = (side.finish() for side in sides)
    loss_diff = abs(ours["loss"] - theirs["loss"])
    grad_diff = abs(ours["adapter_grad_norm"] - theirs["adapter_grad_norm"]) / theirs["adapter_grad_norm"]
    result = {
        "benchmark": "lora_train_step",
        "model": args.model,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "r": args.r,
        "alpha": 2 * args.r,
        "targets": "all-linear",
        "dtype": "float32",
        "threads": args.threads,
        "torch": torch.__version__,
        "peft": _version("peft"),
        "transformers": _version("transformers"),
        "ours": ours,
        "peft_anchor": theirs,
        "loss_abs_diff": loss_diff,
        "grad_norm_rel_diff": grad_diff,
        "ratio_step_time_ours_over_peft": round(ours["step_s"] / theirs["step_s"], 3),
        "ratio_step_peak_rss_ours_over_peft": round(ours["step_peak_rss_mib"] / theirs["step_peak_rss_mib"], 3),
        "ratio_process_peak_rss_ours_over_peft": round(
            ours["process_peak_rss_mib"] / theirs["process_peak_rss_mib"], 3
        ),
    }
    print(json.dumps(result))
    if loss_diff > 1e-4 * max(1.0, abs(theirs["loss"])) or grad_diff > 1e-3:
        sys.exit("the two sides disagree: they did not compute the same step")


def _version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


if __name__ == "__main__":
    main()

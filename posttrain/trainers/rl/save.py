"""Writing an RL run's model mid-run or at its end: one path for the single process and torchrun's ranks."""

from __future__ import annotations

from pathlib import Path

from posttrain.checkpoint.model import save_trained
from posttrain.distributed.env import barrier, is_main
from posttrain.distributed.processes import write_from_main
from posttrain.trainers.rl.ppo import save_value_head
from posttrain.trainers.rl.run import RLRun


def save_run_model(run: RLRun, out: Path, *, export: bool = False) -> Path:
    """The run's model at `out`: the PEFT adapter with LoRA / QLoRA, else an HF directory (`export`: the final
    save, which turns QAT's fake-quantized layers into real ones), from the whole weights (rank 0 writes under
    torchrun), and the value head beside it. Returns `out`."""
    base = run.cfg.model.name_or_path
    if run.parallel is None or run.parallel.wrapped is None:
        save_trained(run.model, run.tokenizer, out, base_model=base, export=export)
        if run.value_head is not None:
            save_value_head(run.value_head, out)
        return out
    write_from_main(run.parallel, lambda model: save_trained(model, run.tokenizer, out, base_model=base, export=export))
    if run.value_head is not None:
        head = run.parallel.whole(run.value_head)  # fsdp2: gathered on rank 0; ddp: the same on every rank
        if is_main():
            save_value_head(head, out)
        barrier()
    return out

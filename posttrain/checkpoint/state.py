"""A checkpoint that a run continues from bit-exactly, written atomically; used by every trainer.

    checkpoints/step-N/
      <the model>                 what `adapters.save_trained` writes: an HF directory, or the PEFT
                                  adapter with LoRA / QLoRA (the frozen base is rebuilt from the config)
      optimizer.safetensors       the optimizer's tensors (AdamW moments and step counts)
      rng_state.safetensors       torch's generator states (CPU, every CUDA device) of every rank
      modules.safetensors         modules trained beside the model (a reward or value head), if any
      shards/                     instead of the model, optimizer and modules files (and the extras), in an
                                  FSDP2 run: every rank's shards (torch.distributed.checkpoint), loadable at
                                  any world size
      trainer_state.json          step, optimizer skeleton, schedule, every rank's python / numpy RNG, and the
                                  trainer's own counters: data position, bad-step counts, RL policy version, ...
      COMMITTED                   written last, after everything above is fsync'd

Only safetensors and JSON are read back, so resuming never unpickles anything; the one exception is an FSDP2
checkpoint's `shards/.metadata`, torch.distributed.checkpoint's own (pickled) index of the shards. The write goes to a hidden
`.step-N.partial` directory that is renamed into place before the marker; rotation runs after the commit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from posttrain.checkpoint.model import save_trained
from posttrain.checkpoint.optim_state import load_optimizer_plain, optimizer_to_plain, scheduler_to_plain
from posttrain.checkpoint.rng_state import capture_rank_rngs, restore_rank_rng
from posttrain.checkpoint.save import checkpoint_dir, commit, fsync_dir, fsync_tree, partial_dir, prune_checkpoints
from posttrain.distributed.checkpoint import is_sharded_checkpoint, load_sharded, save_sharded
from posttrain.distributed.env import barrier, is_main
from posttrain.distributed.parallel import Parallel
from posttrain.errors import CheckpointError
from posttrain.models.checkpoint_io import hf_to_ours, read_our_tensors
from posttrain.peft import active_adapter, has_adapters, load_lora_state_dict
from posttrain.peft.peft_format import KEY_PREFIX, LORA_SUFFIXES, read_adapter_tensors

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng_state.safetensors"
MODULES_FILE = "modules.safetensors"
SHARDS_DIR = "shards"  # FSDP2 runs: model + optimizer as torch.distributed.checkpoint shards
FORMAT_VERSION = 1


class Stateful(Protocol):
    """Anything whose state is plain JSON: a data stream, a prompt source, a counter."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Checkpointer:
    """Everything a trainer's step reads that changes as it trains, and how to save and restore it.

    Build it after the optimizer, the schedule and the data streams exist (and after any reference model
    was copied from the initial weights), then `restore` a checkpoint before the first step and call
    `save(step)` every save_every steps.
    """

    command: str  # sft, dpo, ...: a checkpoint resumes only the command that wrote it
    run_dir: Path
    model: nn.Module
    tokenizer: Any
    base_model: str  # recorded in a LoRA adapter's config
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    modules: dict[str, nn.Module] = field(default_factory=dict)  # trained beside the model
    state: dict[str, Stateful] = field(default_factory=dict)
    keep_last: int | None = None
    write_extras: Callable[[Path], object] | None = None  # user-facing files (score.safetensors); not under fsdp2
    parallel: Parallel | None = None  # under torchrun: who writes what (see `save`)

    def save(self, step: int) -> Path:
        """Write checkpoint `step`, commit it, then prune old ones. Returns its directory.

        Under torchrun every rank calls this: with DDP rank 0 writes (the ranks hold the same weights and
        optimizer state); with FSDP2 each rank writes its shards (`shards/`, torch.distributed.checkpoint)
        and rank 0 the rest. Rank 0 commits once every rank's part is on disk. Every rank's RNG state is
        gathered to rank 0 (a few KB each)."""
        sharded = self.parallel is not None and self.parallel.strategy == "fsdp2"
        tmp, final = partial_dir(self.run_dir, step), checkpoint_dir(self.run_dir, step)
        if is_main() and tmp.exists():
            shutil.rmtree(tmp)  # left by a crash in an earlier save of this step
        if sharded:
            if is_main():
                tmp.mkdir(parents=True)
            barrier()
            # collective: every rank its shards, of the model and of the modules beside it
            save_sharded(self.model, self.optimizer, tmp / SHARDS_DIR, self.modules)
            barrier()
        rng_plain, rng_tensors = capture_rank_rngs()  # collective: every rank's own streams
        if not is_main():
            barrier()  # wait for rank 0's commit, so no rank runs ahead of a half-written checkpoint
            return final
        if sharded:
            optimizer_plain = None  # in shards/, by parameter name
            if self.tokenizer is not None:
                self.tokenizer.save(tmp)
        else:
            save_trained(self.model, self.tokenizer, tmp, base_model=self.base_model)
            optimizer_plain, optimizer_tensors = optimizer_to_plain(self.optimizer)
            save_file(optimizer_tensors, str(tmp / OPTIMIZER_FILE))
        save_file(rng_tensors, str(tmp / RNG_FILE))
        if self.modules and not sharded:  # in shards/ under fsdp2
            tensors = {
                f"{name}.{key}": value.detach().to("cpu").contiguous()
                for name, module in self.modules.items()
                for key, value in module.state_dict().items()
            }
            save_file(tensors, str(tmp / MODULES_FILE))
        if self.write_extras is not None and not sharded:  # they would need whole weights gathered: final/ has them
            self.write_extras(tmp)
        record = {
            "format": FORMAT_VERSION,
            "command": self.command,
            "step": step,
            "optimizer": optimizer_plain,
            "scheduler": scheduler_to_plain(self.scheduler) if self.scheduler is not None else None,
            "rng": rng_plain,
            "state": {name: obj.state_dict() for name, obj in self.state.items()},
        }
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)  # a torn step-N, or one of a timeline abandoned by resuming from an older step
        os.replace(tmp, final)
        fsync_dir(final.parent)
        commit(final, json.dumps({"step": step}) + "\n")
        prune_checkpoints(self.run_dir, self.keep_last)
        barrier()
        return final

    def restore(self, path: str | Path) -> int:
        """Load checkpoint `path` into the live objects; returns its step (the number of finished steps).
        The RNG states go last, so nothing done while restoring draws from them."""
        path = Path(path)
        record = read_trainer_state(path)
        if record.get("command") != self.command:
            raise CheckpointError(
                f"{path}: written by `posttrain {record.get('command')}`, cannot resume `posttrain {self.command}`"
            )
        sharded = is_sharded_checkpoint(path / SHARDS_DIR)
        if sharded:  # written by FSDP2 ranks: resharded to this run's layout, whatever its world size
            load_sharded(self.model, self.optimizer, path / SHARDS_DIR, self.modules)
        elif self.parallel is not None and self.parallel.strategy == "fsdp2":
            raise CheckpointError(
                f"{path}: written by a single-process or ddp run (whole weights); dist.strategy=fsdp2 "
                "resumes from sharded checkpoints only: resume it with dist.strategy=ddp or none"
            )
        else:
            load_trained_weights(self.model, path)
        if self.modules and not sharded:
            tensors = _read_tensors(path / MODULES_FILE)
            for name, module in self.modules.items():
                own = {key[len(name) + 1 :]: value for key, value in tensors.items() if key.startswith(name + ".")}
                try:
                    module.load_state_dict(own)
                except RuntimeError as error:
                    raise CheckpointError(f"{path / MODULES_FILE}: module {name!r}: {error}") from None
        if not sharded:
            load_optimizer_plain(
                self.optimizer, record["optimizer"], _read_tensors(path / OPTIMIZER_FILE), str(path / OPTIMIZER_FILE)
            )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(record["scheduler"])
        saved = record.get("state", {})
        for name, obj in self.state.items():
            if name not in saved:
                raise CheckpointError(f"{path / STATE_FILE}: no state for {name!r}")
            obj.load_state_dict(saved[name])
        ctx = self.parallel.ctx if self.parallel is not None else None
        restore_rank_rng(
            record["rng"],
            _read_tensors(path / RNG_FILE),
            str(path / RNG_FILE),
            rank=ctx.rank if ctx is not None else 0,
            world_size=ctx.world_size if ctx is not None else 1,
        )
        return int(record["step"])


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {STATE_FILE} (a model-only checkpoint cannot be resumed)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: not a trainer state of format {FORMAT_VERSION}")
    return record


def load_trained_weights(model: nn.Module, path: str | Path) -> None:
    """Copy what `save_trained` wrote at `path` back into the live, prepared `model` (same Parameters, so
    the optimizer keeps pointing at them): the adapters with LoRA, else every weight. Every trainable
    parameter must be covered, so a checkpoint of another setup fails here instead of training on."""
    path = Path(path)
    if has_adapters(model):
        adapter = active_adapter(model)
        state = {}
        for key, tensor in read_adapter_tensors(path).items():
            suffix = next((s for s in LORA_SUFFIXES if key.endswith(s)), None)
            ours = (
                hf_to_ours(key[len(KEY_PREFIX) : -len(suffix)] + ".weight")
                if key.startswith(KEY_PREFIX) and suffix
                else None
            )
            if ours is None:
                raise CheckpointError(f"{path}: unexpected adapter tensor {key!r}")
            state[f"{ours.removesuffix('.weight')}{suffix.removesuffix('.weight')}.{adapter}.weight"] = tensor
        load_lora_state_dict(model, state, source=str(path))
        loaded = set(state)
    else:
        state = read_our_tensors(path)
        result = model.load_state_dict(state, strict=False)
        tied = model.lm_head.weight is model.embed_tokens.weight if hasattr(model, "lm_head") else False
        missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
        if result.unexpected_keys or missing:
            raise CheckpointError(
                f"{path}: the saved weights do not fit this model (missing {missing[:3]}, "
                f"unexpected {result.unexpected_keys[:3]})"
            )
        loaded = set(state) | ({"lm_head.weight"} if tied else set())
    untouched = [name for name, p in model.named_parameters() if p.requires_grad and name not in loaded]
    if untouched:
        raise CheckpointError(f"{path}: holds no value for trainable parameter {untouched[0]!r}")


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{file}: cannot read safetensors (truncated or corrupt: {error})") from None

"""Checkpoint I/O: HF safetensors directories in and out, GGUF in (through `gguf_io`).

Our parameter names are HF's with the `model.` prefix dropped, so the mapping is a short table of
prefixes (data, read by one function) rather than per-tensor code. Weights are only ever read from
safetensors or GGUF: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from posttrain.errors import CheckpointError
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer

# (HF prefix, our prefix): the whole name map. Applied first match wins.
HF_TO_OURS_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.", ""),
    ("lm_head.", "lm_head."),
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' / 'float32' / torch.dtype / None -> torch.dtype | None, with a clear error for anything else.
    'auto' is None: the loader's default for the device (the compute dtype is the trainers' business)."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return None if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def hf_to_ours(name: str) -> str | None:
    for hf_prefix, our_prefix in HF_TO_OURS_PREFIXES:
        if name.startswith(hf_prefix):
            return our_prefix + name[len(hf_prefix) :]
    return None


def ours_to_hf(name: str) -> str:
    for hf_prefix, our_prefix in HF_TO_OURS_PREFIXES:
        if our_prefix and name.startswith(our_prefix):
            return hf_prefix + name[len(our_prefix) :]
    return HF_TO_OURS_PREFIXES[0][0] + name


def build_model(
    cfg: ModelConfig, hf_tensors: dict[str, torch.Tensor], source: str, dtype: torch.dtype, device: torch.device | str
) -> Transformer:
    """Assemble a Transformer from HF-named tensors, checking names and shapes against the config."""
    model = Transformer(cfg, device="meta")
    expected = dict(model.state_dict(keep_vars=True))
    state: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_tensors.items():
        name = hf_to_ours(hf_name)
        if name is None or name not in expected:
            if hf_name.endswith("rotary_emb.inv_freq"):  # some old checkpoints store this buffer
                continue
            if _is_extra_layer(cfg, hf_name):
                continue
            raise CheckpointError(f"{source}: unexpected tensor {hf_name!r} for a {cfg.model_type} model")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{source}: missing tensors {', '.join(ours_to_hf(m) for m in missing[:3])}{more}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device)


def _is_extra_layer(cfg: ModelConfig, hf_name: str) -> bool:
    """DeepSeek-V3 checkpoints append their multi-token-prediction module as layers past num_hidden_layers;
    it plays no part in next-token logits (transformers skips it too)."""
    parts = hf_name.split(".")
    return (
        cfg.model_type == "deepseek_v3"
        and len(parts) > 2
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and int(parts[2]) >= cfg.num_hidden_layers
    )


def read_json_object(file: Path, missing: str) -> dict[str, Any]:
    """The JSON object in `file`; a CheckpointError saying `missing` when there is no such file, or naming the
    file when it is not JSON or not an object."""
    if not file.is_file():
        raise CheckpointError(missing)
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: top level must be a JSON object")
    return value


def read_hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    hf = read_json_object(config_file, f"{path}: no config.json (expected an HF model directory)")
    return ModelConfig.from_hf(hf, source=str(config_file))


def read_our_tensors(path: Path) -> dict[str, torch.Tensor]:
    """`read_safetensors` under our module names; a tensor with no name of ours is a CheckpointError."""
    tensors: dict[str, torch.Tensor] = {}
    for hf_name, tensor in read_safetensors(path).items():
        name = hf_to_ours(hf_name)
        if name is None:
            raise CheckpointError(f"{path}: unexpected tensor {hf_name!r}")
        tensors[name] = tensor
    return tensors


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory: model.safetensors, or the shards named by its index."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: shard named in the index is missing")
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: cannot read safetensors (truncated or corrupt: {exc})") from None
    return tensors


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    path = Path(path)
    cfg = read_hf_config(path)
    return build_model(cfg, read_safetensors(path), str(path), dtype, device)


def hf_state_dict(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (tied lm_head left out, as transformers saves it)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        t = tensor.detach().to("cpu")
        out[ours_to_hf(name)] = (t.to(dtype) if dtype is not None else t).contiguous()
    return out


def save_hf_dir(
    model: Transformer,
    out: str | Path,
    tokenizer: Any | None = None,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write an HF model directory that `AutoModelForCausalLM.from_pretrained` loads.

    Written into a temporary sibling and renamed into place, so a crash never leaves a half-written
    checkpoint at `out`. An existing `out` is replaced only after the new one is complete.
    """

    def fill(tmp: Path) -> None:
        tensors = hf_state_dict(model, dtype)
        saved_dtype = dtype or model.dtype
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf(dtype_name(saved_dtype)), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(model.config), indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    return write_dir_atomically(Path(out), fill)


def write_dir_atomically(out: Path, fill: Callable[[Path], None]) -> Path:
    """`fill(tmp)` writes a directory's files into a temporary sibling of `out`, which is then renamed into
    place: a crash never leaves a half-written directory at `out`, and an existing `out` is replaced only
    once the new one is complete. Returns `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    return {k: v for k, v in gen.items() if v is not None}

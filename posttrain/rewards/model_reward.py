"""A reward model as a sequence scorer: prompt + completion -> one float from a scalar head.

On-disk format (what the reward-model trainer writes and `RewardModelScorer(<dir>)` reads): an
ordinary posttrain / HF causal-LM directory (config.json, model.safetensors, tokenizer files) plus

    score.safetensors    "score.weight"  (1, hidden_size)   the scalar head, fp32
                         "score.bias"    (1,)               optional

The score of a sequence is `score(final_norm_hidden[last token])`: the decoder's final-norm hidden
state of the last real token through the head (HF's `*ForSequenceClassification` reads the same
position). The LM head in model.safetensors is loaded but unused. `save_score_head` writes the file.

How a sample becomes tokens is `encode_for_scoring` — the reward-model trainer must use the same:
plain strings: `tokenizer.encode(prompt + completion, add_special_tokens=True)`; chat messages:
`tokenizer.apply_chat_template(prompt + completion, add_generation_prompt=False)`. A sequence longer
than `max_length` keeps its last `max_length` tokens (the completion end matters most).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from posttrain.data.config import DataConfig
from posttrain.data.formats import Preference
from posttrain.data.preference_pairs import PairRow
from posttrain.data.tokenize import TokenizedRow
from posttrain.data.validate import RowError
from posttrain.errors import CheckpointError
from posttrain.models.checkpoint_io import load_hf_dir, parse_dtype
from posttrain.models.transformer import Transformer
from posttrain.rewards.base import RewardError
from posttrain.tokenizer import Tokenizer

SCORE_HEAD_FILE = "score.safetensors"
SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"


def save_score_head(head: nn.Linear, directory: str | Path) -> Path:
    """Write `head` (nn.Linear(d, 1)) as <directory>/score.safetensors in fp32."""
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise RewardError(f"save_score_head: expected nn.Linear(hidden_size, 1), got {head!r}")
    tensors = {SCORE_WEIGHT: head.weight.detach().float().cpu().contiguous()}
    if head.bias is not None:
        tensors[SCORE_BIAS] = head.bias.detach().float().cpu().contiguous()
    path = Path(directory) / SCORE_HEAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def load_score_head(directory: str | Path, hidden_size: int) -> nn.Linear:
    """Read <directory>/score.safetensors into an fp32 nn.Linear(hidden_size, 1), checking names and shapes."""
    path = Path(directory) / SCORE_HEAD_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{Path(directory)}: no {SCORE_HEAD_FILE} (a reward model directory needs its score head)"
        )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read safetensors ({error})") from None
    unexpected = sorted(set(tensors) - {SCORE_WEIGHT, SCORE_BIAS})
    if SCORE_WEIGHT not in tensors or unexpected:
        raise CheckpointError(
            f"{path}: expected tensors {SCORE_WEIGHT!r} (+ optional {SCORE_BIAS!r}), "
            f"found {', '.join(sorted(tensors)) or 'none'}"
        )
    weight = tensors[SCORE_WEIGHT]
    if tuple(weight.shape) != (1, hidden_size):
        raise CheckpointError(
            f"{path}: {SCORE_WEIGHT!r} has shape {tuple(weight.shape)}, the model needs (1, {hidden_size})"
        )
    bias = tensors.get(SCORE_BIAS)
    if bias is not None and tuple(bias.shape) != (1,):
        raise CheckpointError(f"{path}: {SCORE_BIAS!r} has shape {tuple(bias.shape)}, expected (1,)")
    head = nn.Linear(hidden_size, 1, bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight.float())
        if bias is not None:
            head.bias.copy_(bias.float())
    return head


def encode_for_scoring(tokenizer: Tokenizer, prompt: Any, completion: Any) -> list[int]:
    """Token ids of one (prompt, completion) pair as the reward model reads it (see the module docstring)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return tokenizer.encode(prompt + completion, add_special_tokens=True)
    if _is_messages(prompt) and _is_messages(completion):
        ids = tokenizer.apply_chat_template(list(prompt) + list(completion), add_generation_prompt=False, tokenize=True)
        return list(ids)
    raise TypeError(
        f"prompt and completion must both be strings or both be chat message lists, "
        f"got {type(prompt).__name__} and {type(completion).__name__}"
    )


def _is_messages(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(m, Mapping) for m in value)


def tokenize_pair_for_scoring(tokenizer: Any, example: Preference, cfg: DataConfig) -> PairRow:
    """A preference pair as the reward model reads it (`encode_for_scoring`; labels = ids): the
    tokenization the reward-model trainer trains on and `eval preference` scores. Over `cfg.max_length`
    a sequence is a bad row (`overlong: skip`) or keeps its last max_length tokens."""
    rows = []
    for completion in (example.chosen, example.rejected):
        ids = encode_for_scoring(tokenizer, example.prompt, completion)
        if len(ids) > cfg.max_length:
            if cfg.overlong == "skip":
                raise RowError(f"too long: {len(ids)} tokens > max_length {cfg.max_length} (data.overlong=skip)")
            ids = ids[-cfg.max_length :]
        if not ids:
            raise RowError("encodes to no tokens")
        rows.append(TokenizedRow(ids, list(ids)))
    return PairRow(*rows)


class RewardModelScorer:
    """Reward function backed by a reward model: `scorer(prompts, completions, **columns) -> list[float]`.

    `RewardModelScorer(<dir>)` loads the model, tokenizer and score head from a reward-model directory
    (format in the module docstring); `RewardModelScorer(model, tokenizer, score_head)` wraps modules
    already in memory, as they are (no copy, no move, no change of mode: a head still being trained is
    scored with its current weights). `device` / `dtype` apply to a directory only: default the first
    accelerator (else CPU) and bf16 there (fp32 on CPU). Sequences are scored in batches of `batch_size`,
    sorted by length, right-padded; padding does not change a score. A sample that encodes to no tokens
    gets None.
    """

    def __init__(
        self,
        model_path_or_module: str | Path | Transformer,
        tokenizer: Tokenizer | None = None,
        score_head: nn.Linear | None = None,
        *,
        batch_size: int = 8,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_length: int | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RewardError(f"RewardModelScorer: batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(model_path_or_module, (str, Path)):
            directory = Path(model_path_or_module).expanduser()
            if not directory.is_dir():
                raise CheckpointError(f"{directory}: reward model directory not found")
            target = (
                torch.device(device)
                if device is not None
                else torch.device("cuda" if torch.cuda.is_available() else "cpu")
            )
            torch_dtype = parse_dtype(dtype) or (torch.float32 if target.type == "cpu" else torch.bfloat16)
            model = load_hf_dir(directory, dtype=torch_dtype, device=target).eval()
            tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(directory)
            score_head = score_head if score_head is not None else load_score_head(directory, model.config.hidden_size)
        elif isinstance(model_path_or_module, Transformer):
            model = model_path_or_module  # used as it is: its device, dtype and train/eval mode are the caller's
            if tokenizer is None or score_head is None:
                raise RewardError("RewardModelScorer: a model given as a module needs its tokenizer and score_head")
            if device is not None or dtype is not None:
                raise RewardError("RewardModelScorer: device / dtype apply to a directory; move the module yourself")
        else:
            raise RewardError(
                f"RewardModelScorer: expected a reward model directory or a posttrain Transformer, "
                f"got {type(model_path_or_module).__name__}"
            )
        hidden = model.config.hidden_size
        if not isinstance(score_head, nn.Linear) or (score_head.in_features, score_head.out_features) != (hidden, 1):
            raise RewardError(f"RewardModelScorer: score_head must be nn.Linear({hidden}, 1), got {score_head!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.score_head = score_head  # read at every call, so a head still being trained is scored as it is now
        self.batch_size = batch_size
        self.max_length = max_length or model.config.max_position_embeddings

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        if len(prompts) != len(completions):
            raise ValueError(f"RewardModelScorer: {len(prompts)} prompts but {len(completions)} completions")
        sequences = [encode_for_scoring(self.tokenizer, p, c)[-self.max_length :] for p, c in zip(prompts, completions)]
        return self.score_ids(sequences)

    @torch.inference_mode()
    def score_ids(self, sequences: Sequence[Sequence[int]]) -> list[float | None]:
        """One score per token-id sequence (None for an empty one)."""
        scores: list[float | None] = [None] * len(sequences)
        order = sorted((i for i, ids in enumerate(sequences) if len(ids) > 0), key=lambda i: len(sequences[i]))
        device = self.model.device
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            lengths = torch.tensor([len(sequences[i]) for i in chunk], device=device)  # (b,)
            ids = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long, device=device)  # (b, T)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
            mask = torch.arange(ids.shape[1], device=device)[None, :] < lengths[:, None]  # (b, T) right padding
            hidden = self.model.hidden_states(ids, attention_mask=mask.long())  # (b, T, d)
            last = hidden[torch.arange(len(chunk), device=device), lengths - 1]  # (b, d)
            weight = self.score_head.weight.to(device=device, dtype=torch.float32)  # (1, d)
            bias = None if self.score_head.bias is None else self.score_head.bias.to(device=device, dtype=torch.float32)
            values = nn.functional.linear(last.float(), weight, bias).squeeze(-1)  # (b,)
            for i, value in zip(chunk, values.tolist()):
                scores[i] = value
        return scores

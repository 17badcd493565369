"""A smaller model from a checkpoint by keeping a subset of its decoder layers ("layer dropping"):
the student `posttrain distill` (trainers/distill.py) trains, written by `posttrain convert --num-layers`.

The student for distilling a model into a smaller one with the same tokenizer, when no smaller
pretrained sibling is at hand: keep, say, every other layer of the teacher. The kept layers keep their
weights and their order; the embeddings, the final norm and the LM head are copied unchanged. Such a
student starts far from the teacher (each kept layer now reads a residual stream it was not trained
on), but it keeps the teacher's embeddings, tokenizer and most of its per-layer features; DistilBERT
(Sanh et al. 2019) initialised its student the same way, from every other layer of its teacher.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from posttrain.errors import PosttrainError
from posttrain.models.transformer import Transformer

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def evenly_spaced_layers(total: int, count: int) -> list[int]:
    """`count` of `total` layer indices spread evenly, the first one always kept: 30 -> 15 is 0, 2, ..., 28."""
    if not 1 <= count <= total:
        raise PosttrainError(f"cannot keep {count} of {total} layers (choose 1..{total})")
    return [i * total // count for i in range(count)]


def parse_layer_list(text: str, total: int) -> list[int]:
    """ "0,2,4" -> [0, 2, 4]: increasing indices of existing layers."""
    try:
        keep = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PosttrainError(f"--keep-layers: expected comma-separated layer indices, got {text!r}") from None
    check_layer_list(keep, total)
    return keep


def check_layer_list(keep: Sequence[int], total: int) -> None:
    if not keep:
        raise PosttrainError("keep at least one layer")
    if any(b <= a for a, b in zip(keep, keep[1:])):
        raise PosttrainError(f"layer indices must be increasing, got {list(keep)}")
    if keep[0] < 0 or keep[-1] >= total:
        raise PosttrainError(f"layer indices must lie in 0..{total - 1}, got {list(keep)}")


def keep_layers(model: Transformer, keep: Sequence[int]) -> Transformer:
    """A new model with decoder layers `keep` of `model` (renumbered 0..len(keep)-1), weights copied."""
    cfg = model.config
    check_layer_list(keep, cfg.num_hidden_layers)
    layer_types = [cfg.layer_types[i] for i in keep] if cfg.layer_types is not None else None
    new_cfg = dataclasses.replace(cfg, num_hidden_layers=len(keep), layer_types=layer_types)
    if cfg.moe is not None and any(cfg.moe.is_sparse(old) != cfg.moe.is_sparse(new) for new, old in enumerate(keep)):
        raise PosttrainError(
            "these layers would change which layers are mixture-of-experts (the config's dense/sparse "
            "pattern is by position); keep layers whose position keeps their kind"
        )
    renumber = {old: new for new, old in enumerate(keep)}
    state = {}
    for name, tensor in model.state_dict().items():
        match = _LAYER_KEY.match(name)
        if match is None:
            state[name] = tensor.detach().clone()
        elif int(match.group(1)) in renumber:
            state[f"layers.{renumber[int(match.group(1))]}." + name[match.end() :]] = tensor.detach().clone()
    student = Transformer(new_cfg, device="meta")
    student.load_state_dict(state, strict=True, assign=True)
    if new_cfg.tie_word_embeddings:
        student.lm_head.weight = student.embed_tokens.weight
    return student.to(model.device)

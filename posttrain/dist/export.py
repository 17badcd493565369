"""One full model out of FSDP2 shards: for the final HF directory (and anything else that wants whole weights).

Every rank takes part in the gather (an all-gather per parameter); only rank 0 keeps the result, on CPU, so
the full weights never sit on a device next to the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from posttrain.models.transformer import Transformer


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole (unsharded) CPU tensors of `model` on rank 0; an empty dict on the other ranks. Collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_copy(model: Transformer) -> Transformer | None:
    """A plain `Transformer` holding `model`'s full weights on rank 0 (CPU), None on the other ranks.
    Collective: every rank must call it. For a model that is not sharded, `model` itself."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):
        return model
    state = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    copy = Transformer(model.config, device="meta")
    copy.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_word_embeddings:
        copy.lm_head.weight = copy.embed_tokens.weight  # assign=True gives each name its own tensor
    return copy.eval()

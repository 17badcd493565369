"""What an attention call is given besides the tokens: the dense path's mask and positions, or the paged
path's KV cache blocks and slots (see attention.py). The engine fills in `PagedAttentionMetadata`; the
model reads it. A leaf of models: the attention and the paged kernel both import it, it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.models.paged_workspace import PagedWorkspace


@dataclass
class DenseAttentionMetadata:
    """mask (B, 1, T, T) bool, True where query t may attend key s; None means plain causal.

    positions (B, T): the tokens' positions; layers with a sliding window keep keys whose position is
    less than `window` before the query's (positions, not indices, so packed rows whose completions
    share a prompt slide correctly). The windowed masks are built once per forward, on first use.
    """

    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def mask_for_window(self, window: int | None, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """The mask for a layer with this sliding window (None: full attention, the plain mask)."""
        if window is None:
            return self.mask
        if window not in self._windowed:
            idx = torch.arange(seq_len, device=device)
            base = self.mask if self.mask is not None else (idx[None, :] <= idx[:, None])[None, None]  # (B|1, 1, T, T)
            pos = self.positions if self.positions is not None else idx[None]  # (B|1, T)
            near = (pos[:, None, :, None] - pos[:, None, None, :]) < window  # (B|1, 1, T, T)
            eye = torch.eye(seq_len, dtype=torch.bool, device=device)[None, None]
            self._windowed[window] = (base & near) | eye
        return self._windowed[window]


@dataclass
class PagedAttentionMetadata:
    """What one engine step needs; S sequences, N new tokens in all, in sequence order.

    kv_caches[layer]: (2, num_blocks, block_size, n_kv_heads, head_dim), K at [0] and V at [1].
    slot_mapping (N,): flat slot (block_id * block_size + offset) where each new token's K/V is written;
        a negative slot means "do not write" (its K/V is already cached).
    block_tables (S, max_blocks): the cache blocks of each sequence, in order (padded with 0).
    context_lens (S,): tokens each sequence can see after this step's writes (cached + new).
    query_lens (S,): new tokens per sequence this step; they are the last query_lens of its context.
    max_query_len: max(query_lens); 1 means a pure decode step.
    workspace: the plan, staged K/V and scratch buffers the caller keeps across layers and steps (the engine's
        runner passes its own; the default is a fresh one, see paged_workspace.py).
    native_kernels: whether the CPU path may take posttrain.kernels (EngineConfig.cpu_kernels).
    backend: which kernel attends (posttrain/models/paged_attention.py, `PAGED_BACKENDS`); None: the CPU
        fast path on CPU, the reference elsewhere. The engine sets it from EngineConfig.attention_backend.

    A pool block sits at one logical index in every table that lists it: its K/V carry their positions
    (RoPE), so blocks are shared only as common prefixes. The FlexAttention kernel relies on it.
    """

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    max_query_len: int
    workspace: PagedWorkspace = field(default_factory=PagedWorkspace, repr=False, compare=False)
    native_kernels: bool = True
    backend: str | None = None
    _plans: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)

    def cached_plan(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """A kernel's per-step plan, built at the first layer that asks and shared by the others."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]


AttentionMetadata = DenseAttentionMetadata | PagedAttentionMetadata

"""The per-step plan of the paged attention's CPU path: which rows of a step decode and which prefill, how
decoding sequences group by shared leading blocks (the n samples of a prompt), and the index tensors each
kernel needs. It depends only on the step's metadata, so `plan_for` builds it at the first layer and
every other layer reuses it (posttrain/models/paged_attention.py runs the kernels).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from posttrain.models.attention_metadata import PagedAttentionMetadata
from posttrain.models.decode_staging import StagingPlan, SuffixStaging


@dataclass
class DecodePlan:
    """Sequences with one new token. Every one attends its suffix blocks; members of a group also
    attend the group's shared prefix blocks, merged by log-sum-exp."""

    token_rows: torch.Tensor  # (Sd,) row of q / out of each decode sequence
    suffix_blocks: torch.Tensor  # (Sd, Bs) blocks after the shared prefix, padded with block 0
    suffix_mask: torch.Tensor | None  # (Sd, 1, 1, Bs * block_size) additive 0 / -inf, None if nothing padded
    # The cascade part, None when no group shares a block.
    group_blocks: torch.Tensor | None = None  # (Gp, Bp) shared prefix blocks of each group
    group_mask: torch.Tensor | None = None  # (Gp, 1, 1, Bp * block_size) additive, None if all equal
    group_query_rows: torch.Tensor | None = None  # (Gp * M,) q row of each member slot (padding repeats a row)
    members_per_group: int = 0  # M
    member_slot: torch.Tensor | None = None  # (Sc,) slot (g * M + j) of each grouped decode sequence
    grouped: torch.Tensor | None = None  # (Sc,) index into the decode sequences of each grouped one
    # The suffixes kept gathered across steps (decode_staging); None: gather them this step.
    staging: StagingPlan | None = None


@dataclass
class NativeDecodePlan:
    """Sequences with one new token, for the C kernel (posttrain.kernels.decode_attention): groups of
    consecutive sequences read their shared leading blocks once."""

    tables: torch.Tensor  # (Sd, W) block tables
    context_lens: torch.Tensor  # (Sd,)
    rows: torch.Tensor  # (Sd,) row of q / out of each decode sequence
    group_starts: torch.Tensor  # (G + 1,) the members of group g are [group_starts[g], group_starts[g + 1])
    group_shared: torch.Tensor  # (G,) leading blocks the members share (0: a lone sequence)
    max_members: int


@dataclass
class PrefillPlan:
    token_rows: torch.Tensor  # (Np,) rows of q / out, sequence by sequence
    blocks: torch.Tensor  # (Sp, B) block tables
    query_lens: torch.Tensor  # (Sp,)
    mask: torch.Tensor  # (Sp, 1, Q, B * block_size) bool, causal within the context
    max_query_len: int


@dataclass
class Plan:
    decode: DecodePlan | None
    prefill: PrefillPlan | None
    native_decode: NativeDecodePlan | None = None  # instead of `decode` when the C kernels run


def plan_for(meta: PagedAttentionMetadata, block_size: int, native: bool = False) -> Plan:
    """The plan depends only on the metadata, so build it at layer 0 and reuse it for the others."""
    cached = meta.workspace.plan
    if cached is not None and cached[0]() is meta and cached[1] == native:
        return cached[2]
    plan = _build_plan(meta, block_size, native)
    meta.workspace.plan = (weakref.ref(meta), native, plan)
    return plan


def _build_plan(meta: PagedAttentionMetadata, block_size: int, native: bool) -> Plan:
    query_lens = meta.query_lens.tolist()
    context_lens = meta.context_lens.tolist()
    tables = meta.block_tables
    starts, row = [], 0
    for n in query_lens:
        starts.append(row)
        row += n
    decode = [s for s, n in enumerate(query_lens) if n == 1]
    prefill = [s for s, n in enumerate(query_lens) if n > 1]
    prefill_plan = _prefill_plan(prefill, starts, query_lens, context_lens, tables, block_size) if prefill else None
    if not decode:
        return Plan(None, prefill_plan)
    if native:
        return Plan(None, prefill_plan, _native_decode_plan(decode, starts, context_lens, tables, block_size))
    decode_plan = _decode_plan(decode, starts, context_lens, tables, block_size, meta.kv_caches, meta.workspace.staging)
    return Plan(decode_plan, prefill_plan)


def _cascade_groups(table: torch.Tensor, ctx: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Groups of consecutive decode sequences (indices into table's rows) that share leading blocks, with
    the number of blocks they attend together; lone sequences, and groups that could share no block,
    are left out. table (Sd, W) block tables, ctx (Sd,) context lengths."""
    # Blocks each sequence shares with the one before it (equal leading block ids = the same K/V).
    if len(ctx) > 1:
        common = (table[1:] == table[:-1]).cumprod(dim=1).sum(dim=1).tolist()  # (Sd - 1,)
    else:
        common = []
    # Cut between neighbours that share nothing, or less than an adjacent pair does (so a group of
    # siblings sharing a long prompt is not merged with strangers that share only a system prompt).
    groups: list[list[int]] = [[0]]
    for i, c in enumerate(common):
        left = common[i - 1] if i > 0 else 0
        right = common[i + 1] if i + 1 < len(common) else 0
        if c == 0 or c < left or c < right:
            groups.append([i + 1])
        else:
            groups[-1].append(i + 1)
    cascade: list[tuple[list[int], int]] = []
    for members in groups:
        if len(members) < 2:
            continue
        n_shared = min(common[j - 1] for j in members[1:])
        # Keep at least the sequence's newest token in its own suffix (the suffix is never empty).
        n_shared = min(n_shared, (min(ctx[j] for j in members) - 1) // block_size)
        if n_shared > 0:
            cascade.append((members, n_shared))
    return cascade


def _native_decode_plan(
    seqs: list[int],
    starts: list[int],
    context_lens: list[int],
    tables: torch.Tensor,
    block_size: int,
) -> NativeDecodePlan:
    ctx = [context_lens[s] for s in seqs]
    table = tables[seqs] if len(seqs) != tables.shape[0] else tables  # (Sd, W)
    shared_by_first = {members[0]: (len(members), n) for members, n in _cascade_groups(table, ctx, block_size)}
    group_starts, group_shared, j = [], [], 0
    while j < len(seqs):  # every sequence in one group: a cascade group, else a group of one
        members, n_shared = shared_by_first.get(j, (1, 0))
        group_starts.append(j)
        group_shared.append(n_shared)
        j += members
    group_starts.append(len(seqs))
    device = tables.device
    return NativeDecodePlan(
        tables=table.to(torch.int64).contiguous(),
        context_lens=torch.tensor(ctx, dtype=torch.int64, device=device),
        rows=torch.tensor([starts[s] for s in seqs], dtype=torch.int64, device=device),
        group_starts=torch.tensor(group_starts, dtype=torch.int64, device=device),
        group_shared=torch.tensor(group_shared, dtype=torch.int64, device=device),
        max_members=max(b - a for a, b in zip(group_starts, group_starts[1:])),
    )


def _decode_plan(
    seqs: list[int],
    starts: list[int],
    context_lens: list[int],
    tables: torch.Tensor,
    block_size: int,
    kv_caches: list[torch.Tensor],
    staging: SuffixStaging,
) -> DecodePlan:
    ctx = [context_lens[s] for s in seqs]
    table = tables[seqs] if len(seqs) != tables.shape[0] else tables  # (Sd, W)
    cascade = _cascade_groups(table, ctx, block_size)
    shared = [0] * len(seqs)  # prefix blocks each decode sequence attends as part of its group
    for members, n_shared in cascade:
        for j in members:
            shared[j] = n_shared
    device = tables.device
    rows = table.tolist()
    suffix_lens = [c - b * block_size for c, b in zip(ctx, shared)]
    suffix_width = max(-(-n // block_size) for n in suffix_lens)
    suffix_blocks = []
    for j, r in enumerate(rows):
        part = r[shared[j] : shared[j] + suffix_width]
        suffix_blocks.append(part + [0] * (suffix_width - len(part)))
    plan = DecodePlan(
        token_rows=torch.tensor([starts[s] for s in seqs], device=device),
        suffix_blocks=torch.tensor(suffix_blocks, device=device),  # (Sd, Bs)
        suffix_mask=_length_mask(suffix_lens, suffix_width * block_size, device),
    )
    plan.staging = staging.plan(kv_caches, plan.suffix_blocks, suffix_lens, shared, block_size)
    if cascade:
        M = max(len(members) for members, _ in cascade)
        Bp = max(n for _, n in cascade)
        group_blocks = [rows[members[0]][:n] + [0] * (Bp - n) for members, n in cascade]  # (Gp, Bp)
        query_rows, member_slot, grouped = [], [], []
        for g, (members, _) in enumerate(cascade):
            member_rows = [starts[seqs[j]] for j in members]
            query_rows += member_rows + [member_rows[0]] * (M - len(members))
            member_slot += [g * M + k for k in range(len(members))]
            grouped += members
        plan.group_blocks = torch.tensor(group_blocks, device=device)
        plan.group_mask = _length_mask([n * block_size for _, n in cascade], Bp * block_size, device)
        plan.group_query_rows = torch.tensor(query_rows, device=device)
        plan.members_per_group = M
        plan.member_slot = torch.tensor(member_slot, device=device)
        plan.grouped = torch.tensor(grouped, device=device)
    return plan


def _length_mask(lengths: list[int], width: int, device: torch.device) -> torch.Tensor | None:
    """(B, 1, 1, width) additive mask: 0 for positions < length, -inf after; None when nothing is masked."""
    if all(n == width for n in lengths):
        return None
    valid = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]  # (B, width)
    mask = torch.zeros(len(lengths), 1, 1, width, device=device)
    return mask.masked_fill_(~valid[:, None, None, :], float("-inf"))


def _prefill_plan(
    seqs: list[int],
    starts: list[int],
    query_lens: list[int],
    context_lens: list[int],
    tables: torch.Tensor,
    block_size: int,
) -> PrefillPlan:
    device = tables.device
    qlens = [query_lens[s] for s in seqs]
    ctx = [context_lens[s] for s in seqs]
    width = max(-(-c // block_size) for c in ctx)
    Q = max(qlens)
    rows = [r for s in seqs for r in range(starts[s], starts[s] + query_lens[s])]
    q_pos = torch.tensor([c - n for c, n in zip(ctx, qlens)], device=device)[:, None] + torch.arange(Q, device=device)
    mask = torch.arange(width * block_size, device=device)[None, None, :] <= q_pos[:, :, None]  # (Sp, Q, L)
    return PrefillPlan(
        token_rows=torch.tensor(rows, device=device),
        blocks=tables[seqs, :width],
        query_lens=torch.tensor(qlens, device=device),
        mask=mask[:, None],
        max_query_len=Q,
    )

"""The training forward over groups of completions that share a prompt, with each prompt computed once.

The RL update packs its rollout groups this way, and the preference trainers each pair (a chosen and
a rejected completion of one prompt: a group of two). A group is one prompt p (P tokens) and its n
completions c_1..c_n. Instead of n rows [p, c_j] (the prompt n times), a group is packed into ONE row

    [ p_0 .. p_{P-1} | c_1[0..L_1-2] | c_2[0..L_2-2] | ... | c_n[0..L_n-2] ]

with a mask where the prompt is causal, and every token of segment j sees the whole prompt and
the earlier tokens of segment j only; positions continue from the prompt in every segment
(c_j[k] at position P + k), exactly as when the completion was generated. A completion's last
token is never an input (nothing is predicted from it), so it is left out of the row.

The logprob of c_j[k] comes from the hidden state that predicts it: the prompt's last token for
k = 0 (one state shared by the n completions), c_j[k-1] otherwise. Only those N = sum_j L_j
states go through the LM head: the prompt positions never become logits. With `scored` masks
(multi-turn episodes: the model's own tokens, not the environment's), only the scored tokens are
gathered, so N counts those alone; the others stay inputs (context) and come back as 0.

The mask and the attention are dense, (T, T) per row: a group of long completions (multi-turn episodes,
long reasoning) makes a wide row whose attention outgrows the rest of the forward. With `row_tokens` a
group is cut into several rows, each the prompt again and as many of the group's consecutive completions
as keep it within row_tokens (one at least), the prompt recomputed once a row.

Shapes: R rows (one a group unless cut), T the packed width, N completion tokens in all, B samples, L the
longest completion. Per-token outputs come back padded to (B, L) with a (B, L) mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posttrain.algos import entropy_from_logits, token_logprobs
from posttrain.models.attention import DenseAttentionMetadata

# The update's rows (trainers/rl/update.py): past ~768 tokens a row's (T, T) attention costs more than a second
# row's prompt (benchmarks/packed_update.py: 8 guess-number episodes of ~170 tokens after a 75-token prompt).
ROW_TOKENS = 768


@dataclass
class PackedGroups:
    input_ids: Tensor  # (R, T)
    positions: Tensor  # (R, T)
    mask: Tensor  # (R, 1, T, T) bool, True where a query may attend a key
    gather_index: Tensor  # (N,) flat index into (R * T) of the state that predicts each completion token
    labels: Tensor  # (N,) the completion tokens
    sample_index: Tensor  # (N,) which sample (0..B-1) each token belongs to
    token_index: Tensor  # (N,) its index inside its completion
    sample_row: Tensor  # (B,) the row of each sample
    row_group: Tensor  # (R,) the group of each row (one row a group unless pack_groups cut them)
    completion_mask: Tensor  # (B, L) float, 1 for real completion tokens
    num_input_tokens: int  # real (unpadded) tokens through the model

    @property
    def num_samples(self) -> int:
        return self.completion_mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.completion_mask.shape[1]

    def to_padded(self, flat: Tensor, fill: float = 0.0) -> Tensor:
        """(N,) per-token values -> (B, L), `fill` outside the completions; differentiable."""
        out = flat.new_full((self.num_samples, self.max_len), fill)
        return out.index_put((self.sample_index, self.token_index), flat)

    def select(self, groups: list[int]) -> PackedGroups:
        """The pack of some of its groups (ascending), cut out of this one: the tensors `pack_groups` would
        build from those groups alone, without packing anything again."""
        T = self.input_ids.shape[1]
        device = self.input_ids.device
        wanted = torch.tensor(groups, dtype=torch.long, device=device)  # (G',)
        rows = torch.nonzero(torch.isin(self.row_group, wanted)).squeeze(1)  # (R',) ascending
        lengths = self.mask[rows, 0, :, 0].sum(-1)  # (R',) real tokens: those that see the prompt's first token
        width = int(lengths.max())
        new_row = torch.full((self.input_ids.shape[0],), -1, dtype=torch.long, device=device)  # (R,)
        new_row[rows] = torch.arange(len(rows), device=device)
        new_group = torch.searchsorted(wanted, self.row_group[rows])  # (R',) the rows' groups, renumbered
        token_row = new_row[self.gather_index // T]  # (N,) each token's row in the selection, -1: left out
        kept = token_row >= 0  # (N,)
        # (B',) ascending: group by group, as pack_groups numbers; a sample with no scored token stays in
        samples = torch.nonzero(new_row[self.sample_row] >= 0).squeeze(1)
        new_sample = torch.full((self.num_samples,), -1, dtype=torch.long, device=device)  # (B,)
        new_sample[samples] = torch.arange(len(samples), device=device)
        completion_mask = self.completion_mask[samples]  # (B', L)
        return PackedGroups(
            input_ids=self.input_ids[rows, :width],
            positions=self.positions[rows, :width],
            mask=self.mask[rows][:, :, :width, :width],
            gather_index=token_row[kept] * width + self.gather_index[kept] % T,
            labels=self.labels[kept],
            sample_index=new_sample[self.sample_index[kept]],
            token_index=self.token_index[kept],
            sample_row=new_row[self.sample_row[samples]],
            row_group=new_group,
            completion_mask=completion_mask[:, : int(completion_mask.sum(1).max())],
            num_input_tokens=int(lengths.sum()),
        )


def pack_groups(
    prompts: list[list[int]],
    completions: list[list[list[int]]],
    device: torch.device | str = "cpu",
    scored: list[list[list[int | float]]] | None = None,
    row_tokens: int | None = None,
) -> PackedGroups:
    """One packed row per group. prompts[g]: token ids; completions[g][j]: the j-th completion's ids
    (non-empty). Samples are numbered group by group: sample b = g * n_g + j. scored[g][j] (optional, one
    flag per token of completions[g][j]): only the tokens flagged non-zero get a logprob. row_tokens: cut a
    group wider than that into rows (see the module docstring)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
    if scored is not None and [[len(c) for c in group] for group in scored] != [
        [len(c) for c in group] for group in completions
    ]:
        raise ValueError("scored must hold one flag per completion token, group by group")
    rows, segs, pos_rows = [], [], []
    gather, labels, sample_idx, token_idx, sample_row, row_group = [], [], [], [], [], []
    lengths: list[int] = []
    for g, (prompt, group) in enumerate(zip(prompts, completions)):
        P = len(prompt)
        if P == 0:
            raise ValueError(f"group {g}: empty prompt (a completion needs a state to be predicted from)")
        for j, completion in enumerate(group):
            if not completion:
                raise ValueError(f"group {g}, completion {j}: empty (the engine always returns >= 1 token)")
        for chunk in _row_chunks(P, [len(c) - 1 for c in group], row_tokens):
            r = len(rows)
            row_group.append(g)
            ids, seg, pos = list(prompt), [0] * P, list(range(P))
            for segment_id, j in enumerate(chunk, start=1):
                completion = group[j]
                b = len(lengths)
                lengths.append(len(completion))
                sample_row.append(r)
                start = len(ids)  # where c_j[0] sits in the row (if it is an input)
                predictors = [P - 1] + [start + k for k in range(len(completion) - 1)]
                flags = scored[g][j] if scored is not None else [1] * len(completion)
                picked = [k for k, flag in enumerate(flags) if flag]
                gather.extend((r, predictors[k]) for k in picked)
                labels.extend(completion[k] for k in picked)
                sample_idx.extend([b] * len(picked))
                token_idx.extend(picked)
                inputs = completion[:-1]
                ids.extend(inputs)
                seg.extend([segment_id] * len(inputs))
                pos.extend(range(P, P + len(inputs)))
            rows.append(ids)
            segs.append(seg)
            pos_rows.append(pos)
    T = max(len(r) for r in rows)
    R = len(rows)
    input_ids = torch.zeros(R, T, dtype=torch.long)
    segment = torch.full((R, T), -1, dtype=torch.long)  # -1: padding
    positions = torch.zeros(R, T, dtype=torch.long)
    for r, (ids, seg, pos) in enumerate(zip(rows, segs, pos_rows)):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        segment[r, : len(seg)] = torch.tensor(seg)
        positions[r, : len(pos)] = torch.tensor(pos)
    idx = torch.arange(T)
    causal = (idx[:, None] >= idx[None, :])[None]  # (1, T, T)
    same_segment = segment[:, :, None] == segment[:, None, :]  # (R, T, T)
    key_in_prompt = (segment == 0)[:, None, :]  # (R, 1, T)
    real_query = (segment >= 0)[:, :, None]  # (R, T, 1)
    mask = causal & (same_segment | key_in_prompt) & real_query
    mask = (mask | torch.eye(T, dtype=torch.bool)[None])[:, None]  # (R, 1, T, T); a pad query sees itself
    L = max(lengths)
    completion_mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).float()  # (B, L)
    flat = torch.tensor([r * T + t for r, t in gather], dtype=torch.long)
    return PackedGroups(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        mask=mask.to(device),
        gather_index=flat.to(device),
        labels=torch.tensor(labels, dtype=torch.long, device=device),
        sample_index=torch.tensor(sample_idx, dtype=torch.long, device=device),
        token_index=torch.tensor(token_idx, dtype=torch.long, device=device),
        sample_row=torch.tensor(sample_row, dtype=torch.long, device=device),
        row_group=torch.tensor(row_group, dtype=torch.long, device=device),
        completion_mask=completion_mask.to(device),
        num_input_tokens=sum(len(r) for r in rows),
    )


def _row_chunks(prompt_len: int, inputs: list[int], row_tokens: int | None) -> list[list[int]]:
    """A group's completions (their input counts: inputs[j]) cut into rows of consecutive ones: a completion
    that would take its row past row_tokens starts the next row, where it fits after the prompt (else it stays:
    a row of its own would be as wide and cost the prompt again); one row when row_tokens is None."""
    if row_tokens is None:
        return [list(range(len(inputs)))]
    chunks: list[list[int]] = [[]]
    width = prompt_len
    for j, n in enumerate(inputs):
        if chunks[-1] and width + n > row_tokens and prompt_len + n <= row_tokens:
            chunks.append([])
            width = prompt_len
        chunks[-1].append(j)
        width += n
    return chunks


@dataclass
class ForwardOut:
    logprobs: Tensor  # (B, L) log softmax(z / T)[token], 0 outside the completions
    entropy: Tensor | None  # (B, L) entropy of softmax(z / T), when asked
    values: Tensor | None  # (B, L) value-head output at each token's predicting state, when a head is given
    hidden: Tensor  # (N, d) the predicting states (for callers that project them further)


def packed_forward(
    model: nn.Module,
    packed: PackedGroups,
    temperature: float,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    value_head: nn.Module | None = None,
) -> ForwardOut:
    """Per-token logprobs (and optionally entropy, values) of every completion token, from one
    forward of the packed rows. Differentiable unless called under no_grad."""
    hidden = model.hidden_states(
        packed.input_ids, positions=packed.positions, attn_meta=DenseAttentionMetadata(packed.mask)
    )  # (R, T, d)
    states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.gather_index)  # (N, d)
    logits = model.logits(states).unsqueeze(0)  # (1, N, V)
    logprobs = token_logprobs(logits, packed.labels.unsqueeze(0), temperature).squeeze(0)  # (N,)
    entropy = None
    if with_entropy:
        if entropy_grad:
            flat_entropy = entropy_from_logits(logits, temperature=temperature).squeeze(0)  # (N,)
        else:
            with torch.no_grad():
                flat_entropy = entropy_from_logits(logits.detach(), temperature=temperature).squeeze(0)
        entropy = packed.to_padded(flat_entropy)
    values = None
    if value_head is not None:
        values = packed.to_padded(value_head(states).squeeze(-1).float())  # (B, L)
    return ForwardOut(packed.to_padded(logprobs), entropy, values, states)


def per_sample_logprobs(
    model: nn.Module, prompts: list[list[int]], completions: list[list[int]], temperature: float
) -> list[Tensor]:
    """The plain forward: one row [prompt, completion] per sample, full logits. The oracle for the packed
    forward (tests) and a fallback; returns each completion's (L_b,) logprobs."""
    out = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion], device=model.device)  # (1, P + L)
        logits = model(ids)[:, len(prompt) - 1 : -1]  # (1, L, V)
        out.append(token_logprobs(logits, ids[:, len(prompt) :], temperature).squeeze(0))
    return out

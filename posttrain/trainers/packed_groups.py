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
states go through the LM head: the prompt positions never become logits.

Shapes: R groups (rows), T the packed width, N completion tokens in all, B samples, L the
longest completion. Per-token outputs come back padded to (B, L) with a (B, L) mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posttrain.algos import entropy_from_logits, token_logprobs
from posttrain.models.attention import DenseAttentionMetadata


@dataclass
class PackedGroups:
    input_ids: Tensor  # (R, T)
    positions: Tensor  # (R, T)
    mask: Tensor  # (R, 1, T, T) bool, True where a query may attend a key
    gather_index: Tensor  # (N,) flat index into (R * T) of the state that predicts each completion token
    labels: Tensor  # (N,) the completion tokens
    sample_index: Tensor  # (N,) which sample (0..B-1) each token belongs to
    token_index: Tensor  # (N,) its index inside its completion
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
        """The pack of some of its groups (rows, ascending), cut out of this one: the tensors `pack_groups`
        would build from those groups alone, without packing anything again."""
        T = self.input_ids.shape[1]
        rows = torch.tensor(groups, dtype=torch.long, device=self.input_ids.device)  # (R',)
        lengths = self.mask[rows, 0, :, 0].sum(-1)  # (R',) real tokens: those that see the prompt's first token
        width = int(lengths.max())
        new_row = torch.full((self.input_ids.shape[0],), -1, dtype=torch.long, device=rows.device)  # (R,)
        new_row[rows] = torch.arange(len(groups), device=rows.device)
        token_row = new_row[self.gather_index // T]  # (N,) each token's row in the selection, -1: left out
        kept = token_row >= 0  # (N,)
        samples = torch.unique(self.sample_index[kept])  # (B',) ascending: group by group, as pack_groups numbers
        new_sample = torch.full((self.num_samples,), -1, dtype=torch.long, device=rows.device)  # (B,)
        new_sample[samples] = torch.arange(len(samples), device=rows.device)
        completion_mask = self.completion_mask[samples]  # (B', L)
        return PackedGroups(
            input_ids=self.input_ids[rows, :width],
            positions=self.positions[rows, :width],
            mask=self.mask[rows][:, :, :width, :width],
            gather_index=token_row[kept] * width + self.gather_index[kept] % T,
            labels=self.labels[kept],
            sample_index=new_sample[self.sample_index[kept]],
            token_index=self.token_index[kept],
            completion_mask=completion_mask[:, : int(completion_mask.sum(1).max())],
            num_input_tokens=int(lengths.sum()),
        )


def pack_groups(
    prompts: list[list[int]], completions: list[list[list[int]]], device: torch.device | str = "cpu"
) -> PackedGroups:
    """One packed row per group. prompts[g]: token ids; completions[g][j]: the j-th completion's ids
    (non-empty). Samples are numbered group by group: sample b = g * n_g + j."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completion groups")
    rows, segs, pos_rows = [], [], []
    gather, labels, sample_idx, token_idx = [], [], [], []
    lengths: list[int] = []
    for g, (prompt, group) in enumerate(zip(prompts, completions)):
        P = len(prompt)
        if P == 0:
            raise ValueError(f"group {g}: empty prompt (a completion needs a state to be predicted from)")
        ids, seg, pos = list(prompt), [0] * P, list(range(P))
        for j, completion in enumerate(group):
            if not completion:
                raise ValueError(f"group {g}, completion {j}: empty (the engine always returns >= 1 token)")
            b = len(lengths)
            lengths.append(len(completion))
            start = len(ids)  # where c_j[0] sits in the row (if it is an input)
            predictors = [P - 1] + [start + k for k in range(len(completion) - 1)]
            gather.extend((g, t) for t in predictors)
            labels.extend(completion)
            sample_idx.extend([b] * len(completion))
            token_idx.extend(range(len(completion)))
            inputs = completion[:-1]
            ids.extend(inputs)
            seg.extend([j + 1] * len(inputs))
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
    flat = torch.tensor([g * T + t for g, t in gather], dtype=torch.long)
    return PackedGroups(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        mask=mask.to(device),
        gather_index=flat.to(device),
        labels=torch.tensor(labels, dtype=torch.long, device=device),
        sample_index=torch.tensor(sample_idx, dtype=torch.long, device=device),
        token_index=torch.tensor(token_idx, dtype=torch.long, device=device),
        completion_mask=completion_mask.to(device),
        num_input_tokens=sum(len(r) for r in rows),
    )


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

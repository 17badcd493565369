"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023), as pure tensor functions.

A proposer drew draft token d_i from a distribution q_i (a point mass when it is deterministic: n-gram lookup,
a greedy draft model). The target's distributions p_i at the same positions come from one forward. Draft i is
accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, until the first rejection; a rejected position
draws its token from the residual max(0, p_i - q_i), normalised; when every draft is accepted, one more token is
drawn from the target's distribution after the last. Every token that comes out is then distributed exactly as
the target's own draw would be, whatever q is: at a position, P(x) = min(p(x), q(x)) + (1 - sum min(p, q)) *
residual(x) = p(x). A greedy target is the case where each p_i is a point mass at its argmax: a draft is
accepted exactly when it is that argmax, and a rejected position takes the argmax.
"""

from __future__ import annotations

import torch

from posttrain.engine.sampler import sample_from_weights


def residual_distribution(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) per row, unnormalised; p where that leaves no mass (p == q up to rounding, when a rejection
    had probability ~0). target, draft (B, V) -> (B, V)."""
    residual = (target - draft).clamp_(min=0.0)  # (B, V)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # (B, 1)
    return torch.where(empty, target, residual)


def verify_drafts(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over B sequences with up to K drafts each.

    target_probs (B, K + 1, V): the target's draw distribution (normalised) at each draft's position and one past
    the last draft of each sequence (row num_drafts[b]); draft_tokens (B, K) int64 and num_drafts (B,) int64: the
    drafts, padded; draft_probs (B, K, V): the distribution each draft was drawn from, or None when every draft
    is a point mass; uniforms (B, K + 1) in [0, 1): K acceptance tests, then the draw of the last token (zeros
    are right for greedy targets: a point mass needs no randomness).
    Returns (num_accepted (B,) int64, next_token (B,) int64): each sequence keeps draft_tokens[b, :num_accepted[b]]
    and then next_token[b].
    """
    batch, max_drafts = draft_tokens.shape
    device = target_probs.device
    positions = torch.arange(max_drafts, device=device)  # (K,)
    p_of_draft = target_probs[:, :max_drafts].gather(2, draft_tokens[..., None]).squeeze(-1)  # (B, K)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # (B, K)
    # u < p / q, without dividing by a q that may be 0 at padding: u * q < p.
    accepted = (uniforms[:, :max_drafts].to(p_of_draft.dtype) * q_of_draft < p_of_draft) & (
        positions < num_drafts[:, None]
    )  # (B, K)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (B,) drafts before the first rejection
    rows = torch.arange(batch, device=device)
    target_last = target_probs[rows, num_accepted]  # (B, V) the distribution of the next token
    rejected = num_accepted < num_drafts  # (B,)
    weights = target_last
    if bool(rejected.any()):
        at = num_accepted.clamp(max=max_drafts - 1)  # (B,) the rejected position (any valid row when none)
        if draft_probs is None:
            draft_last = torch.zeros_like(target_last)
            draft_last[rows, draft_tokens[rows, at]] = 1.0  # the point mass at the rejected draft
        else:
            draft_last = draft_probs[rows, at]  # (B, V)
        weights = torch.where(rejected[:, None], residual_distribution(target_last, draft_last), target_last)
    next_token = sample_from_weights(weights.float(), uniforms[:, max_drafts])  # (B,)
    return num_accepted, next_token


def verify_greedy_drafts(logits: torch.Tensor, drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """`verify_drafts` for greedy targets without penalties or masks, straight from the logits: a draft is kept while
    it is its row's argmax (the first maximum: the token `sample` picks), and the row after the kept drafts gives the
    next token. No distribution is formed and no random number drawn. logits (R, V): each sequence's 1 + k rows in
    turn, k = len(drafts[b]). Returns (num_accepted, next_token) per sequence."""
    best = logits.max(dim=-1).indices.tolist()  # (R,)
    num_accepted, next_token = [], []
    first = 0
    for tokens in drafts:
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == best[first + accepted]:
            accepted += 1
        num_accepted.append(accepted)
        next_token.append(best[first + accepted])
        first += len(tokens) + 1
    return num_accepted, next_token

"""Mixture-of-experts MLP as Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 configure it.

A router scores the experts for each token, keeps the top k (one routing function per variant, in
ROUTERS), and the token's output is the weighted sum of those experts' SwiGLU outputs, plus an
always-on shared expert where the family has one. Module and parameter names are the checkpoints'
own (`experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`, DeepSeek's `shared_experts`),
so the HF name map stays a prefix table and LoRA targets carry over.

After each forward a block keeps its routing (`last_routing`); `router_loss_and_metrics(model)` turns
what the blocks recorded into the load-balancing loss and the expert-load metrics the trainers log.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.family_config import MoEConfig
from posttrain.models.layers import SwiGLU

# model_type -> the attribute names the checkpoints use (default: "mlp" / "shared_expert").
FFN_NAMES: dict[str, str] = {"mixtral": "block_sparse_moe"}
SHARED_EXPERT_NAMES: dict[str, str] = {"deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts"}


class MixtralExpert(nn.Module):
    """SwiGLU under Mixtral's names: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, dim: int, hidden: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, device=device)
        self.w2 = nn.Linear(hidden, dim, bias=False, device=device)
        self.w3 = nn.Linear(dim, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Expert scores per token: logits = x @ weight.T, in fp32 so near-ties route the same under bf16.

    Not an nn.Linear on purpose: LoRA and weight quantization leave routers alone."""

    def __init__(self, dim: int, moe: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, dim, device=device))
        if self.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if moe.score_correction_bias:
            # DeepSeek-V3: added to the scores only to choose experts (balancing without an aux loss).
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts, device=device))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, d) -> logits (N, E) fp32."""
        return F.linear(x.float(), self.weight.float())


# ---- routing variants: (logits (N, E) fp32, config, correction bias) -> weights (N, k) fp32, experts (N, k) ----

RouteFn = Callable[[torch.Tensor, MoEConfig, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"]


def _route_softmax(
    logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # Mixtral, Qwen-MoE, DeepSeek-V2 "greedy": the k most probable experts.
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(moe.num_experts_per_tok, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * moe.routed_scaling_factor, experts


def _group_mask(group_scores: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """(N, E) bool: experts in each token's topk_group best groups (group_scores (N, G))."""
    chosen = group_scores.topk(moe.topk_group, dim=-1).indices  # (N, topk_group)
    groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)  # (N, G)
    return groups.repeat_interleave(moe.num_experts // moe.n_group, dim=1)  # (N, E)


def _route_softmax_group_limited(
    logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # DeepSeek-V2 "group_limited_greedy": groups ranked by their best expert; top k inside the chosen groups.
    probs = logits.softmax(dim=-1)
    N, E = probs.shape
    group_scores = probs.view(N, moe.n_group, E // moe.n_group).amax(dim=-1)  # (N, G)
    probs = probs.masked_fill(~_group_mask(group_scores, moe), 0.0)
    weights, experts = probs.topk(moe.num_experts_per_tok, dim=-1)
    return weights * moe.routed_scaling_factor, experts


def _route_sigmoid_group_limited(
    logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # DeepSeek-V3 "noaux_tc": sigmoid scores; the bias steers the choice (groups ranked by their two best
    # experts) but the weights are the unbiased scores, renormalised and scaled.
    scores = logits.sigmoid()
    N, E = scores.shape
    choice = scores if bias is None else scores + bias.float()
    group_scores = choice.view(N, moe.n_group, E // moe.n_group).topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
    choice = choice.masked_fill(~_group_mask(group_scores, moe), float("-inf"))
    experts = choice.topk(moe.num_experts_per_tok, dim=-1).indices  # (N, k)
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


ROUTERS: dict[str, RouteFn] = {
    "softmax": _route_softmax,
    "softmax_group_limited": _route_softmax_group_limited,
    "sigmoid_group_limited": _route_sigmoid_group_limited,
}


@dataclass
class Routing:
    """What one block's router did in the last forward, for the aux loss and the load metrics."""

    router_logits: torch.Tensor  # (N, E) fp32, differentiable in training
    experts: torch.Tensor  # (N, k) chosen expert ids


class MoEBlock(nn.Module):
    """x (..., d) -> (..., d): routed experts (+ the shared expert), names as in the family's checkpoints."""

    def __init__(self, model_type: str, dim: int, moe: MoEConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.route = ROUTERS[moe.router]
        self.gate = Router(dim, moe, device)
        hidden = moe.moe_intermediate_size
        expert = MixtralExpert if model_type == "mixtral" else SwiGLU
        self.experts = nn.ModuleList(expert(dim, hidden, device) for _ in range(moe.num_experts))
        self.shared_name = SHARED_EXPERT_NAMES.get(model_type, "shared_expert")
        if moe.shared_expert_intermediate_size:
            self.add_module(self.shared_name, SwiGLU(dim, moe.shared_expert_intermediate_size, device))
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False, device=device) if moe.shared_expert_gate else None
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        logits = self.gate(flat)  # (N, E)
        weights, experts = self.route(logits, self.moe, self.gate.e_score_correction_bias)  # (N, k) each
        # The engine's forwards (inference mode; in asynchronous RL another thread's, during the update) do not
        # record: the routing the update's router loss reads is its own forward's.
        if not torch.is_inference_mode_enabled():
            self.last_routing = Routing(logits, experts)
        out = self._routed(flat, weights.to(x.dtype), experts)
        if self.moe.shared_expert_intermediate_size:
            shared = getattr(self, self.shared_name)(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each expert runs once on the rows routed to it; results are scattered back weighted."""
        k = experts.shape[1]
        flat = experts.reshape(-1)  # (N * k,) assignment -> expert
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()  # one host sync per block
        rows = order // k  # (N * k,) the token of each sorted assignment
        w = weights.reshape(-1).index_select(0, order)[:, None]  # (N * k, 1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                token_rows = rows[start : start + n]
                y = self.experts[e](x.index_select(0, token_rows)) * w[start : start + n]  # (n, d)
                out.index_add_(0, token_rows, y)
            start += n
        return out


# ---- the router's training signal and metrics --------------------------------------------------------


def load_balancing_loss(
    router_logits: list[torch.Tensor], num_experts: int, top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss as transformers computes it: E * sum_e f_e * P_e, with f_e the
    share of top-k assignments that went to expert e (summing to k) and P_e its mean router probability,
    both over every layer's tokens. router_logits: one (N, E) per sparse layer; token_mask (N,) or any
    shape of N elements, 1 for real tokens (padding left out)."""
    probs = torch.cat([logits.float().softmax(dim=-1) for logits in router_logits])  # (L * N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L * N, k)
    hits = torch.zeros_like(probs).scatter_(1, chosen, 1.0)  # (L * N, E)
    if token_mask is None:
        weight = probs.new_ones(probs.shape[0])
    else:
        weight = token_mask.reshape(-1).to(probs).repeat(len(router_logits))  # (L * N,)
    total = weight.sum()
    tokens_per_expert = (hits * weight[:, None]).sum(dim=0) / total  # (E,)
    prob_per_expert = (probs * weight[:, None]).sum(dim=0) / total  # (E,)
    return num_experts * (tokens_per_expert * prob_per_expert).sum()


def expert_load(experts: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """experts (N, k) chosen ids -> (E,) assignments per expert (padding rows left out)."""
    weight = None
    if token_mask is not None:
        weight = token_mask.reshape(-1, 1).to(torch.float32).expand(experts.shape).reshape(-1)
    return torch.bincount(experts.reshape(-1), weights=weight, minlength=num_experts).float()


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def router_loss_and_metrics(
    model: nn.Module, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Consume the routing the model's MoE blocks recorded in its last forward.

    Returns (loss term, metrics). The loss term is router_aux_loss_coef * load-balancing loss, a
    differentiable scalar to add to a mean-style loss (None for a dense model, or a coefficient of 0).
    token_mask: 1 for real tokens, in the layout of the forward's input ids ((B, T) dense); None = all.
    Metrics: router/aux_loss (unweighted), router/load_cv (std / mean of the per-expert assignment
    counts, mean over sparse layers; 0 is perfectly balanced), router/load_max and router/load_min
    (the busiest and idlest expert's share times E over all sparse layers; 1.0 is balanced).
    """
    blocks = [b for b in moe_blocks(model) if b.last_routing is not None]
    if not blocks:
        return None, {}
    moe = blocks[0].moe
    routings = [b.last_routing for b in blocks]
    for b in blocks:
        b.last_routing = None  # each forward's routing counts once
    aux = load_balancing_loss([r.router_logits for r in routings], moe.num_experts, moe.num_experts_per_tok, token_mask)
    with torch.no_grad():
        loads = torch.stack([expert_load(r.experts, moe.num_experts, token_mask) for r in routings])  # (L, E)
        share = loads / loads.sum(dim=1, keepdim=True).clamp(min=1.0) * moe.num_experts  # (L, E), 1 = balanced
        cv = loads.std(dim=1, unbiased=False) / loads.mean(dim=1).clamp(min=1e-9)  # (L,)
    metrics = {
        "router/aux_loss": float(aux.detach()),
        "router/load_cv": float(cv.mean()),
        "router/load_max": float(share.max()),
        "router/load_min": float(share.min()),
    }
    term = moe.router_aux_loss_coef * aux if moe.router_aux_loss_coef > 0 else None
    return term, metrics


def add_router_loss(
    model: nn.Module, loss_sum: torch.Tensor, token_mask: torch.Tensor | None, num_items: float, total_items: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """For a trainer whose micro-batch loss is a sum over `num_items` (tokens) of the step's `total_items`:
    adds the router loss term (a per-token mean) scaled to that sum, and returns the router metrics
    weighted by num_items / total_items, so summing them over the step's micro-batches gives their
    token-weighted means. A dense model gets (loss_sum, {}) back."""
    term, metrics = router_loss_and_metrics(model, token_mask)
    if term is not None:
        loss_sum = loss_sum + term * num_items
    share = num_items / max(total_items, 1e-9)
    return loss_sum, {key: value * share for key, value in metrics.items()}

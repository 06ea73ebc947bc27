"""Mixture-of-experts in plain torch: routing, the experts' grouped GEMMs and the weighted sum as one op,
written to match Hugging Face's float math (Qwen2-MoE, Qwen3-MoE, Mixtral: `*TopKRouter` and `*Experts`
in transformers 5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROUTINGS = ("softmax_topk",)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, routing: str = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's `top_k` experts.

    "softmax_topk": softmax over all experts in float32, then `torch.topk` of those probabilities (ties
    pick what HF picks: the same call on the same float32 values), then the k weights divided by their
    sum iff `renormalize` (Qwen's norm_topk_prob; Mixtral always, which equals a softmax over the top-k
    logits)."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown MoE routing {routing!r}; known: {', '.join(ROUTINGS)}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def active_experts(router_logits: torch.Tensor, top_k: int) -> list[int]:
    """The experts some token routes to, ascending: the only ones `fused_moe` computes (the routing
    weights' renormalization does not change which experts are chosen)."""
    _, ids = route(router_logits, top_k, renormalize=False)
    return sorted(set(ids.reshape(-1).tolist()))


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: str = "softmax_topk",
    weights_in_hidden_dtype: bool = True,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] for tokens `hidden` [T, H].

    `router_logits` [T, E] (float32: the router's output upcast), `w13` [E, 2I, H] (each expert's gate
    rows, then its up rows), `w2` [E, H, I]. Tokens are grouped by expert and only the experts some token
    chose run, each once for all its tokens: silu(gate) * up, then down, times the token's routing
    weight, added into the output in the hidden dtype in ascending expert order (as HF's loop does).
    `weights_in_hidden_dtype`: the routing weights are rounded to the hidden dtype first (Qwen's router
    does; Mixtral's keeps them float32 and rounds the product)."""
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    weights, ids = route(router_logits, top_k, renormalize, routing)
    if weights_in_hidden_dtype:
        weights = weights.to(hidden.dtype)
    out = torch.zeros_like(hidden)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue  # (an expert no token chose: its weights are not read)
        rows = tokens[start : start + count]
        x = hidden[rows]
        gate_up = F.linear(x, w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert]) * pair_weights[start : start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out

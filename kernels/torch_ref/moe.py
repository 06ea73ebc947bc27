"""Mixture-of-experts in plain torch: routing, the experts' grouped GEMMs and the weighted sum as one op,
written to match Hugging Face's float math (Qwen2-MoE, Qwen3-MoE, Mixtral: `*TopKRouter` and `*Experts`
in transformers 5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.torch_ref.layers import silu_and_mul


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's `top_k` experts: softmax over all
    experts in float32, then `torch.topk` of those probabilities (ties pick what HF picks: the same call on
    the same float32 values), then the k weights divided by their sum iff `renormalize` (Qwen's
    norm_topk_prob; Mixtral always, which equals a softmax over the top-k logits)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_in_hidden_dtype: bool = True,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] for tokens `hidden` [T, H].

    `router_logits` [T, E] (float32: the router's output upcast), `w13` [E, 2I, H] (each expert's gate
    rows, then its up rows), `w2` [E, H, I]. Tokens are grouped by expert and only the experts some token
    chose run, each once for all its tokens: silu(gate) * up, then down, times the token's routing
    weight, added into the output in the hidden dtype in ascending expert order (as HF's loop does).
    `weights_in_hidden_dtype`: the routing weights are rounded to the hidden dtype first (Qwen's router
    does; Mixtral's keeps them float32 and rounds the product)."""
    weights, ids = route(router_logits, top_k, renormalize)
    if weights_in_hidden_dtype:
        weights = weights.to(hidden.dtype)
    out = torch.zeros_like(hidden)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)  # the chosen experts only
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):  # (one host read per layer)
        rows = tokens[start : start + count]
        y = F.linear(silu_and_mul(F.linear(hidden[rows], w13[expert])), w2[expert])
        out.index_add_(0, rows, (y * pair_weights[start : start + count, None]).to(out.dtype))
        start += count
    return out

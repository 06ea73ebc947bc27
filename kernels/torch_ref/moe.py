"""Mixture-of-experts in plain torch: routing, the experts' grouped GEMMs and the weighted sum as one op,
written to match Hugging Face's float math (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss, Gemma 4: `*TopKRouter`
/ `*Router` and `*Experts` in transformers 5)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts
from pagoda.kernels.torch_ref.layers import silu_and_mul


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after_topk: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's `top_k` experts: softmax over all
    experts in float32, then `torch.topk` of those probabilities (ties pick what HF picks: the same call on
    the same float32 values), then the k weights divided by their sum iff `renormalize` (Qwen's
    norm_topk_prob; Mixtral always, which equals a softmax over the top-k logits). `softmax_after_topk`
    (gpt-oss): `torch.topk` of the logits themselves, then a softmax over those k."""
    if softmax_after_topk:
        logits, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(logits, dim=-1, dtype=torch.float32), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class Routing:
    """How a layer's router picks and weighs each token's experts, and which experts this rank holds.

    `top_k` experts per token; `renormalize`: their weights divided by their sum (Qwen's norm_topk_prob;
    Mixtral always). `weights_in_hidden_dtype`: the weights are rounded to the hidden dtype before the
    experts' outputs are scaled (Qwen's routers do; Mixtral's keep them float32 and round the product).
    `expert_offset` / `local_experts`: expert parallel, where this rank's stacked weights hold the experts
    `expert_offset .. expert_offset + local_experts - 1` (None: all of them) and only the tokens' pairs with
    those experts are computed here; the ranks' partial sums are added by the caller.
    `softmax_after_topk` (gpt-oss): the top-k logits are picked first and the softmax runs over those k
    (`route`). `expert_scales` (Gemma 4's per_expert_scale, [E] over every expert): each pair's weight is
    multiplied by its expert's scale after the renormalization."""

    top_k: int
    renormalize: bool = False
    weights_in_hidden_dtype: bool = True
    expert_offset: int = 0
    local_experts: int | None = None
    softmax_after_topk: bool = False
    expert_scales: torch.Tensor | None = field(default=None, compare=False)

    def weights_and_ids(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route`'s (weights, expert ids) of every token, the weights scaled by `expert_scales`."""
        weights, ids = route(router_logits, self.top_k, self.renormalize, self.softmax_after_topk)
        if self.expert_scales is not None:
            weights = weights * self.expert_scales[ids]
        return weights, ids


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (HF's `GptOssExperts._apply_gate`): gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). Applied to [..., 2I] rows holding the
    gate half, then the up half (our w13 layout; HF's checkpoints interleave them, the model de-interleaves
    at load)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class GeGLU:
    """Gemma 4's expert activation (HF's `Gemma4TextExperts`, gelu_pytorch_tanh): gelu with the tanh
    approximation of the gate half, times the up half."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# An expert activation other than SiLU-and-mul (None).
Activation = ClampedSwiGLU | GeGLU


@dataclass
class Assignment:
    """A batch's (token, expert) pairs grouped by expert: the experts some token chose (local ids,
    ascending, each once), how many pairs each has, and per pair (in that order, tokens ascending within
    an expert) its token and routing weight."""

    experts: list[int]
    counts: list[int]
    tokens: torch.Tensor  # int64 [P]
    weights: torch.Tensor  # [P], float32 or the hidden dtype (Routing.weights_in_hidden_dtype)


def assign(router_logits: torch.Tensor, routing: Routing, hidden_dtype: torch.dtype) -> Assignment:
    """Route every token, then group the pairs by expert (one host read: the chosen experts' ids and
    counts). Experts no token chose, and under expert parallel other ranks' experts, are absent."""
    weights, ids = routing.weights_and_ids(router_logits)
    if routing.weights_in_hidden_dtype:
        weights = weights.to(hidden_dtype)
    flat, pair_weights = ids.reshape(-1), weights.reshape(-1)
    pairs = torch.arange(flat.numel(), device=flat.device)
    if routing.expert_offset or routing.local_experts is not None:
        flat = flat - routing.expert_offset
        limit = routing.local_experts if routing.local_experts is not None else router_logits.shape[-1]
        mine = (flat >= 0) & (flat < limit)
        flat, pairs = flat[mine], pairs[mine]
    order = torch.argsort(flat, stable=True)  # (pairs grouped by expert, tokens ascending)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    pairs = pairs[order]
    return Assignment(experts.tolist(), counts.tolist(), pairs // routing.top_k, pair_weights[pairs])


# Stacked expert matrices [E, N, K]: a plain tensor, or packed (kernels/panels.py `ExpertPanels`: float32 in
# the CPU matmul's panels; kernels/quantized.py `PackedExperts`: quantized; kernels/mxfp4.py `Mxfp4Experts`:
# gpt-oss's MXFP4), each able to give one expert's matrix (`matrix`).
ExpertWeights = torch.Tensor | ExpertPanels | PackedExperts | Mxfp4Experts


def expert_matrix(weights: ExpertWeights, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert`'s matrix [N, K] of stacked expert weights: a plain tensor's slice, or that expert
    alone unpacked from its panels or dequantized, in `dtype`."""
    if isinstance(weights, torch.Tensor):
        return weights[expert]
    return weights.matrix(expert, dtype)


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    routing: Routing,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Activation | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] for tokens `hidden` [T, H].

    `router_logits` [T, E] (float32: the router's output upcast), `w13` [E, 2I, H] (each expert's gate
    rows, then its up rows), `w2` [E, H, I] (E: this rank's experts, `routing.local_experts`), plain or
    packed (`ExpertWeights`: only the chosen experts are unpacked or dequantized). Tokens are
    grouped by expert (`assign`) and only the experts some token chose run, each once for all its tokens:
    silu(gate) * up, then down, times the token's routing weight, added into the output in the hidden
    dtype in ascending expert order (as HF's loop does).

    gpt-oss's options: `w13_bias` [E, 2I] and `w2_bias` [E, H] added to each expert's projections, and its
    `activation` in place of silu(gate) * up (Gemma 4's too: `GeGLU`)."""
    out = torch.zeros_like(hidden)
    pairs = assign(router_logits, routing, hidden.dtype)
    start = 0
    for expert, count in zip(pairs.experts, pairs.counts, strict=True):
        rows = pairs.tokens[start : start + count]
        gate_up = F.linear(hidden[rows], expert_matrix(w13, expert, hidden.dtype), _of(w13_bias, expert))
        act = silu_and_mul(gate_up) if activation is None else activation(gate_up)
        y = F.linear(act, expert_matrix(w2, expert, hidden.dtype), _of(w2_bias, expert))
        out.index_add_(0, rows, (y * pairs.weights[start : start + count, None]).to(out.dtype))
        start += count
    return out


def _of(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    """Expert `expert`'s bias row, if the experts have biases."""
    return None if bias is None else bias[expert]

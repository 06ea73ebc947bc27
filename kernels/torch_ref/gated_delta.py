"""Gated DeltaNet, the linear-attention mixer of Qwen3.5/3.6 and Qwen3-Next, in plain torch: the reference the C
and Triton kernels are tested against, written after Hugging Face's `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_update`, `Qwen3_5RMSNormGated` and the layer's gating
(transformers 5.25, models/qwen3_5/modeling_qwen3_5.py).

A batch is a varlen batch of new tokens: `cu_seqlens` `[B + 1]` marks where each sequence's tokens start in
the token dimension, and `state_slots` `[B]` says which row of a state pool holds each sequence's state. The
ops read those states and update them in place; rows not named stay untouched. A sequence whose slot has just
been handed out starts from a zeroed state (the caller zeroes it, as HF starts from zeros).

- `causal_conv1d`: the depthwise causal convolution over q/k/v's channels, then SiLU. Its state is the
  sequence's last K - 1 inputs, oldest first: `conv_states` `[slots, K - 1, C]` (a time step's channels
  adjacent, so that a decode step reads whole rows).
- `gated_delta_rule`: per value head, S = S * exp(g); S += k ⊗ (beta * (v - S^T k)); o = S^T q, with q and k
  L2-normalized and q scaled by 1/sqrt(Dk) as HF's `use_qk_l2norm_in_kernel=True` does. States
  `[slots, Hv, Dk, Dv]` float32. Sequences of one token (decode) take the recurrent form, all at once;
  longer ones the chunked form (chunks of 64, as HF): both are here and agree.
- `gdn_gating` (g and beta from the projections a and b) and `rms_norm_gated` (the output norm, gated by
  silu(z)).

Math is float32, as HF's (which casts q, k, v, g and beta to float32 and keeps its states in float32); states
given in float64 make the whole computation float64, which the tests use to compare the two forms closely.
HF keeps its conv state as [C, K - 1] per sequence (time last): ours is its transpose.

The kernels (kernels/cpu/gated_delta.c, kernels/triton/gated_delta.py) run the recurrent form for prompts too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv1d of `x` `[T, C]` (any token stride) with `weight` `[C, K]` (HF's conv1d weight
    without its middle dimension) and `bias` `[C]` or None, then `activation` ("silu" or None). Each
    sequence's window starts with its state `conv_states[slot]` `[K - 1, C]`, which then becomes the last
    K - 1 rows of (state, new tokens). Computed in float32 (HF computes in the weight's dtype, float32 for
    float32 weights) and returned in x's dtype `[T, C]`."""
    width = weight.shape[1]
    compute = torch.float64 if conv_states.dtype == torch.float64 else torch.float32
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.to(compute).t()  # [K, C]
    for start, end, slot in _sequences(cu_seqlens, state_slots):
        length = end - start
        if length == 0:
            continue
        window = torch.cat([conv_states[slot].to(compute), x[start:end].to(compute)])  # [K - 1 + L, C]
        result = window[:length] * w[0]
        for j in range(1, width):
            result = result + window[j : j + length] * w[j]
        if bias is not None:
            result = result + bias.to(compute)
        if activation == "silu":
            result = F.silu(result)
        elif activation is not None:
            raise ValueError(f"unknown activation {activation!r}")
        out[start:end] = result.to(x.dtype)
        conv_states[slot] = window[length:].to(conv_states.dtype)
    return out


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule over a varlen batch. `query`, `key` `[T, Hk, Dk]`, `value` `[T, Hv, Dv]` (views
    with any token stride), `g` `[T, Hv]` (log decays, <= 0), `beta` `[T, Hv]`, `states` `[slots, Hv, Dk, Dv]`
    updated in place at `state_slots`. Value head h reads query/key head h // (Hv / Hk), as HF's
    `repeat_interleave`. Returns `[T, Hv, Dv]` in value's dtype. One-token sequences run the recurrent form
    together; longer ones the chunked form, one sequence at a time."""
    out = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    sequences = list(_sequences(cu_seqlens, state_slots))
    single = [(start, slot) for start, end, slot in sequences if end - start == 1]
    if single:
        tokens = torch.tensor([start for start, _ in single], device=value.device)
        slots = torch.tensor([slot for _, slot in single], device=value.device)
        q, k, v, gt, bt = _prepared(query[tokens], key[tokens], value[tokens], g[tokens], beta[tokens], states.dtype)
        state = states[slots].to(q.dtype)
        q, k, v, gt, bt = (x[:, :, None] for x in (q, k, v, gt, bt))
        o = _recurrent(q, k, v, gt, bt, state, use_qk_l2norm)
        out[tokens] = o[:, :, 0].to(out.dtype)
        states[slots] = state.to(states.dtype)
    for start, end, slot in sequences:
        if end - start > 1:
            rows = slice(start, end)
            q, k, v, gt, bt = _prepared(query[rows], key[rows], value[rows], g[rows], beta[rows], states.dtype)
            state = states[slot : slot + 1].to(q.dtype)
            q, k, v, gt, bt = (x.transpose(0, 1)[None] for x in (q, k, v, gt, bt))
            o = _chunked(q, k, v, gt, bt, state, use_qk_l2norm)
            out[rows] = o[0].transpose(0, 1).to(out.dtype)
            states[slot] = state[0].to(states.dtype)
    return out


def gated_delta_rule_recurrent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`gated_delta_rule` token by token for every sequence (the form the C kernel computes)."""
    out = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    for start, end, slot in _sequences(cu_seqlens, state_slots):
        if end > start:
            rows = slice(start, end)
            q, k, v, gt, bt = _prepared(query[rows], key[rows], value[rows], g[rows], beta[rows], states.dtype)
            state = states[slot : slot + 1].to(q.dtype)
            q, k, v, gt, bt = (x.transpose(0, 1)[None] for x in (q, k, v, gt, bt))
            o = _recurrent(q, k, v, gt, bt, state, use_qk_l2norm)
            out[rows] = o[0].transpose(0, 1).to(out.dtype)
            states[slot] = state[0].to(states.dtype)
    return out


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the projections `a`, `b` `[T, Hv]`: g = -exp(A_log) * softplus(a + dt_bias) in float32,
    beta = sigmoid(b) in b's dtype (HF's Qwen3_5GatedDeltaNet.forward)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3_5RMSNormGated over the last dimension: the RMS norm in float32, times `weight` in x's dtype,
    times silu(gate) in float32, returned in x's dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def _sequences(cu_seqlens: torch.Tensor, state_slots: torch.Tensor):
    """(start, end, slot) of each sequence, as Python ints (the reference loops on the host)."""
    bounds, slots = cu_seqlens.tolist(), state_slots.tolist()
    return zip(bounds[:-1], bounds[1:], slots, strict=True)


def _prepared(query, key, value, g, beta, state_dtype):
    """q, k repeated to the value heads; all [L, H, ...] in the compute dtype."""
    compute = torch.float64 if state_dtype == torch.float64 else torch.float32
    repeat = value.shape[1] // key.shape[1]
    if repeat != 1:
        query = query.repeat_interleave(repeat, dim=1)
        key = key.repeat_interleave(repeat, dim=1)
    return tuple(x.to(compute) for x in (query, key, value, g, beta))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # (HF's l2norm, eps 1e-6)


def _normalized(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def _recurrent(q, k, v, g, beta, state, use_qk_l2norm) -> torch.Tensor:
    """HF's recurrent form on [N, H, L, D] inputs; `state` [N, H, Dk, Dv] is updated in place."""
    q, k = _normalized(q, k, use_qk_l2norm)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for t in range(q.shape[2]):
        state.mul_(g[:, :, t].exp()[..., None, None])
        remembered = (state * k[:, :, t, :, None]).sum(dim=-2)  # S^T k
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state.add_(k[:, :, t, :, None] * delta[..., None, :])
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)  # S^T q
    return out


def _chunked(q, k, v, g, beta, state, use_qk_l2norm, chunk: int = CHUNK_SIZE) -> torch.Tensor:
    """HF's chunked form on [N, H, L, D] inputs (see torch_chunk_gated_delta_rule for the derivation);
    `state` [N, H, Dk, Dv] is updated in place."""
    q, k = _normalized(q, k, use_qk_l2norm)
    length = q.shape[2]
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(*x.shape[:2], -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(*g.shape[:2], -1, chunk).cumsum(dim=-1)  # log of the decay since the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    s = state
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :length]

"""Gated DeltaNet's causal conv1d and delta rule in Triton: the contracts and signatures of
`pagoda.kernels.torch_ref.gated_delta` (varlen batches, states read and updated in place at each sequence's slot).

The delta rule runs token by token (the recurrent form) for decode and prefill alike: one program per
(sequence, value head, block of value columns) holds its [Dk, BLOCK_V] slice of the state in registers across
the sequence's tokens, so the state is read and written once per call. Math in float32.
The conv1d: one program per (sequence, block of channels) walks the sequence's tokens, reading the window from
the state or the new tokens, then shifts the state. Neither reads anything on the host.
The gating and the gated output norm are one element-wise pass each, rounding where the reference rounds.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from pagoda.kernels.triton.layers import _round

_BLOCK_V = 32
_BLOCK_CHANNELS = 128


@triton.jit
def _l2_normalized(x, NORMALIZE: tl.constexpr):
    if NORMALIZE:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)  # (HF's l2norm, eps 1e-6)
    return x


@triton.jit
def _gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_head,
    key_dim,
    value_dim,
    scale,
    GROUP: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq, head, column_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    key_head = head // GROUP
    rows = tl.arange(0, BLOCK_K)
    columns = column_block * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask, column_mask = rows < key_dim, columns < value_dim
    state_ptrs = state_ptr + slot * stride_slot + head * stride_head + rows[:, None] * value_dim + columns[None, :]
    state_mask = row_mask[:, None] & column_mask[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + rows, mask=row_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + rows, mask=row_mask, other=0.0).to(tl.float32)
        q = _l2_normalized(q, NORMALIZE) * scale
        k = _l2_normalized(k, NORMALIZE)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + columns, mask=column_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + head * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + head * stride_bh).to(tl.float32)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # beta (v - S^T k)
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)  # S^T q
        tl.store(
            out_ptr + t * stride_ot + head * stride_oh + columns,
            out.to(out_ptr.dtype.element_ty),
            mask=column_mask,
        )
    tl.store(state_ptrs, state, mask=state_mask)


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
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.gated_delta_rule` (float32 states, contiguous in
    each slot; q, k, v with unit stride along their last dimension)."""
    assert states.dtype == torch.float32 and states[0].is_contiguous(), "states: float32, [Hv, Dk, Dv] contiguous"
    key_heads, key_dim = key.shape[1:]
    value_heads, value_dim = value.shape[1:]
    out = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    batch = state_slots.shape[0]
    if batch == 0 or value.shape[0] == 0:
        return out
    grid = (batch, value_heads, triton.cdiv(value_dim, _BLOCK_V))
    _gated_delta_kernel[grid](
        query,
        key,
        value,
        g,
        beta,
        states,
        cu_seqlens,
        state_slots,
        out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        key_dim,
        value_dim,
        key_dim**-0.5,
        GROUP=value_heads // key_heads,
        NORMALIZE=use_qk_l2norm,
        BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=_BLOCK_V,
    )
    return out


@triton.jit
def _window_row(state_row_ptr, x_ptr, row, history, start, stride_xt, channels, mask):
    """Row `row` of a sequence's window: the state's row while row < history, else token start + row - history."""
    rows = tl.full(mask.shape, 0, tl.int64) + row  # (the row as a vector: masks stay vectors of booleans)
    from_state = tl.load(state_row_ptr + rows * channels, mask=mask & (rows < history), other=0.0)
    from_x = tl.load(x_ptr + (start + rows - history) * stride_xt, mask=mask & (rows >= history), other=0.0)
    return from_state.to(tl.float32) + from_x.to(tl.float32)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    stride_slot,
    channels,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq, block = tl.program_id(0), tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < channels
    history = WIDTH - 1
    state_row_ptr = state_ptr + slot * stride_slot + offsets  # (+ row * channels: the state's row)
    x_column_ptr = x_ptr + offsets
    for t in range(0, length):
        if HAS_BIAS:
            acc = tl.load(bias_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            w = tl.load(weight_ptr + offsets * WIDTH + j, mask=mask, other=0.0).to(tl.float32)
            acc += w * _window_row(state_row_ptr, x_column_ptr, t + j, history, start, stride_xt, channels, mask)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + t) * stride_ot + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # The new state: window rows length .. length + history - 1, written in ascending order. A row still read
    # from the old state lies after every row written so far, and each lane reads and writes its own channel.
    for r in tl.static_range(WIDTH - 1):
        row = _window_row(state_row_ptr, x_column_ptr, r + length, history, start, stride_xt, channels, mask)
        tl.store(state_row_ptr + r * channels, row.to(state_ptr.dtype.element_ty), mask=mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.causal_conv1d` (x with unit channel stride;
    weight, bias and each slot's state contiguous)."""
    if activation not in ("silu", None):
        raise ValueError(f"unknown activation {activation!r}")
    tokens, channels = x.shape
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    batch = state_slots.shape[0]
    if batch == 0 or tokens == 0:
        return out
    grid = (batch, triton.cdiv(channels, _BLOCK_CHANNELS))
    _causal_conv1d_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,  # (not read without a bias)
        conv_states,
        cu_seqlens,
        state_slots,
        out,
        x.stride(0),
        out.stride(0),
        conv_states.stride(0),
        channels,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        WIDTH=weight.shape[1],
        BLOCK=_BLOCK_CHANNELS,
    )
    return out


@triton.jit
def _gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, heads, stride_at, stride_bt, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    mask = h < heads
    x = tl.load(a_ptr + token * stride_at + h, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + h, mask=mask, other=0.0).to(tl.float32)
    # torch's softplus: x itself above 20; log1p(e^x) as e^x where that is what log1p would give
    softplus = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
    g = -tl.exp(tl.load(a_log_ptr + h, mask=mask, other=0.0).to(tl.float32)) * softplus
    tl.store(g_ptr + token * heads + h, g, mask=mask)
    b = tl.load(b_ptr + token * stride_bt + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta_ptr + token * heads + h, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.gdn_gating` (a, b with unit stride along heads)."""
    tokens, heads = a.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        _gating_kernel[(tokens,)](
            a, b, a_log, dt_bias, g, beta, heads, a.stride(0), b.stride(0), BLOCK=triton.next_power_of_2(heads)
        )
    return g, beta


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr, heads, n, stride_xt, stride_zt, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # (token row // heads, head row % heads)
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + token * stride_xt + head * n + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(gate_ptr + token * stride_zt + head * n + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference's rounding points: the norm rounded to x's dtype, times the weight in that dtype, times
    # silu(z) in float32, rounded at the end.
    normed = _round(x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps), dtype)
    y = _round(w * normed, dtype) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * n + cols, y.to(dtype), mask=mask)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.rms_norm_gated`, for rows `[R, n]` or heads
    `[T, H, n]` (a token's heads adjacent, any token stride) of x and gate."""
    n = x.shape[-1]
    heads = 1 if x.dim() == 2 else x.shape[1]
    for t in (x, gate):
        assert t.dim() in (2, 3) and t.stride(-1) == 1 and (t.dim() == 2 or t.stride(1) == n), "heads adjacent"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _rms_norm_gated_kernel[(x.shape[0] * heads,)](
            x, gate, weight, out, heads, n, x.stride(0), gate.stride(0), eps, BLOCK=triton.next_power_of_2(n)
        )
    return out

"""Gated DeltaNet's conv1d and delta rule on the CPU (kernels/cpu/gated_delta.c), float32: the torch references'
contracts (`pagoda.kernels.torch_ref.gated_delta`). Inputs the kernels do not take (other dtypes, layouts
the C code does not read) go to the reference."""

from __future__ import annotations

import torch

from pagoda.kernels.cpu.arguments import THREADED_WORK, as_int64, rows_contiguous
from pagoda.kernels.cpu.loader import load


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
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.gated_delta_rule`; every sequence runs token by
    token (the recurrent form)."""
    lib = load()
    usable = (
        lib is not None
        and all(rows_contiguous(x) for x in (query, key, value))
        and states.dtype == torch.float32
        and states.is_contiguous()
        and value.shape[1] % key.shape[1] == 0
    )
    if not usable:
        from pagoda.kernels.torch_ref.gated_delta import gated_delta_rule as reference

        return reference(query, key, value, g, beta, states, cu_seqlens, state_slots, use_qk_l2norm)
    return _gated_delta_rule(lib, query, key, value, g, beta, states, cu_seqlens, state_slots, use_qk_l2norm)


def _gated_delta_rule(lib, query, key, value, g, beta, states, cu_seqlens, state_slots, use_qk_l2norm):
    tokens, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[1:]
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    # (held in locals: a converted copy must outlive the call, not just its data_ptr())
    cu_seqlens, state_slots = as_int64(cu_seqlens), as_int64(state_slots)
    out = torch.empty(value.shape, dtype=torch.float32)
    batch = state_slots.shape[0]
    work = tokens * value_heads * key_dim * value_dim
    lib["gated_delta_rule_f32"](
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        g.data_ptr(),
        beta.data_ptr(),
        states.data_ptr(),
        cu_seqlens.data_ptr(),
        state_slots.data_ptr(),
        out.data_ptr(),
        batch,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
        query.stride(0),
        key.stride(0),
        value.stride(0),
        int(use_qk_l2norm),
        torch.get_num_threads() if work >= THREADED_WORK else 1,
    )
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.causal_conv1d`."""
    lib = load()
    usable = (
        lib is not None
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (weight, conv_states))
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and activation in ("silu", None)
    )
    if not usable:
        from pagoda.kernels.torch_ref.gated_delta import causal_conv1d as reference

        return reference(x, weight, bias, conv_states, cu_seqlens, state_slots, activation)
    return _causal_conv1d(lib, x, weight, bias, conv_states, cu_seqlens, state_slots, activation)


def _causal_conv1d(lib, x, weight, bias, conv_states, cu_seqlens, state_slots, activation):
    tokens, channels = x.shape
    out = torch.empty(tokens, channels, dtype=torch.float32)
    width = weight.shape[1]
    cu_seqlens, state_slots = as_int64(cu_seqlens), as_int64(state_slots)  # (locals: they outlive the call)
    lib["causal_conv1d_f32"](
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        conv_states.data_ptr(),
        cu_seqlens.data_ptr(),
        state_slots.data_ptr(),
        out.data_ptr(),
        state_slots.shape[0],
        channels,
        width,
        x.stride(0),
        int(activation == "silu"),
        torch.get_num_threads() if tokens * channels * width >= THREADED_WORK else 1,
    )
    return out


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.gdn_gating` (float32: g and beta both float32)."""
    lib = load()
    usable = (
        lib is not None
        and all(t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1 for t in (a, b))
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (a_log, dt_bias))
    )
    if not usable:
        from pagoda.kernels.torch_ref.gated_delta import gdn_gating as reference

        return reference(a, b, a_log, dt_bias)
    return _gdn_gating(lib, a, b, a_log, dt_bias)


def _gdn_gating(lib, a, b, a_log, dt_bias):
    g, beta = torch.empty(a.shape), torch.empty(a.shape)
    lib["gdn_gating_f32"](
        a.data_ptr(), b.data_ptr(), a_log.data_ptr(), dt_bias.data_ptr(), g.data_ptr(), beta.data_ptr(),
        a.shape[0], a.shape[1], a.stride(0), b.stride(0),
    )  # fmt: skip
    return g, beta


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.gated_delta.rms_norm_gated`, for float32 rows `[R, n]` or heads
    `[T, H, n]` (a token's heads adjacent, any token stride: z may be a view of a fused projection)."""
    lib = load()
    usable = (
        lib is not None
        and x.shape == gate.shape
        and all(_heads_adjacent(t) for t in (x, gate))
        and weight.dtype == torch.float32
        and weight.is_contiguous()
    )
    if not usable:
        from pagoda.kernels.torch_ref.gated_delta import rms_norm_gated as reference

        return reference(x, gate, weight, eps)
    return _rms_norm_gated(lib, x, gate, weight, eps)


def _heads_adjacent(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and ((x.dim() == 2 and x.stride(1) == 1) or (x.dim() == 3 and rows_contiguous(x)))


def _rms_norm_gated(lib, x, gate, weight, eps):
    tokens, n = x.shape[0], x.shape[-1]
    heads = 1 if x.dim() == 2 else x.shape[1]
    out = torch.empty(x.shape)
    lib["rms_norm_gated_f32"](
        x.data_ptr(), gate.data_ptr(), weight.data_ptr(), out.data_ptr(), tokens, heads, n, x.stride(0),
        gate.stride(0), eps, torch.get_num_threads() if x.numel() >= THREADED_WORK else 1,
    )  # fmt: skip
    return out

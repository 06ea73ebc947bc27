"""The fused mixture-of-experts on the CPU (kernels/cpu/moe.c): routing and grouping in torch (`assign`), then
one C call per layer for the gathered GEMMs, SiLU-and-mul and weighted sum, with the experts in panels
(`ExpertPanels`) or quantized (`PackedExperts`)."""

from __future__ import annotations

import ctypes

import torch

from pagoda.kernels.cpu.arguments import THREADED_WORK, as_int64, scratch_buffer
from pagoda.kernels.cpu.loader import load
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts
from pagoda.kernels.torch_ref import moe as reference
from pagoda.kernels.torch_ref.moe import ExpertWeights, Routing, assign


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    routing: Routing,
    **options,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.moe.fused_moe`. The C kernel takes float32 tokens and experts
    packed for it (both `ExpertPanels`, or both `PackedExperts`); anything else, and any keyword option (those
    the C kernel does not compute), runs the reference."""
    lib = load()
    if not options and lib is not None and hidden.dtype == torch.float32 and hidden.device.type == "cpu":
        if isinstance(w13, ExpertPanels) and isinstance(w2, ExpertPanels):
            return _fused_moe(lib, hidden, router_logits, w13, w2, routing)
        if isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts):
            return _fused_moe(lib, hidden, router_logits, w13, w2, routing)
    return reference.fused_moe(hidden, router_logits, w13, w2, routing, **options)


def _fused_moe(
    lib,
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: ExpertPanels | PackedExperts,
    w2: ExpertPanels | PackedExperts,
    routing: Routing,
) -> torch.Tensor:
    tokens_count, size = hidden.shape
    inter = w2.in_features
    if (w13.in_features, w13.out_features, w2.out_features) != (size, 2 * inter, size):
        raise ValueError(
            f"fused_moe: hidden size {size}, w13 [{w13.out_features}, {w13.in_features}], w2 "
            f"[{w2.out_features}, {w2.in_features}] per expert: expected [2I, {size}] and [{size}, I]"
        )
    out = torch.zeros(tokens_count, size, dtype=torch.float32)
    pairs = assign(router_logits, routing, hidden.dtype)
    if not pairs.experts:
        return out
    hidden = hidden.contiguous()
    experts = torch.tensor(pairs.experts, dtype=torch.int64)
    counts = torch.tensor(pairs.counts, dtype=torch.int64)
    tokens, weights = as_int64(pairs.tokens), pairs.weights.to(torch.float32).contiguous()
    work = tokens.numel() * 3 * inter * size
    threads = torch.get_num_threads() if work >= THREADED_WORK else 1
    most = max(pairs.counts)
    common = [hidden.data_ptr(), tokens.data_ptr(), weights.data_ptr(), experts.data_ptr(), counts.data_ptr()]
    if isinstance(w13, ExpertPanels):
        workspace = scratch_buffer(lib["moe_workspace"](tokens.numel(), most, size, inter, size, inter, 0, 0, threads))
        done = lib["moe_f32"](
            *common,
            len(pairs.experts),
            w13.data.data_ptr(),
            w2.data.data_ptr(),
            out.data_ptr(),
            workspace.data_ptr(),
            size,
            inter,
            threads,
        )
        return _checked(done, out)
    assert isinstance(w2, PackedExperts)
    layout13, layout2 = _layout(w13), _layout(w2)
    workspace = scratch_buffer(
        lib["moe_workspace"](
            tokens.numel(), most, size, inter, layout13[3], layout2[3], layout13[2], layout2[2], threads
        )
    )
    done = lib["moe_quantized_f32"](
        *common,
        len(pairs.experts),
        *_pointers(w13),
        layout13,
        *_pointers(w2),
        layout2,
        out.data_ptr(),
        workspace.data_ptr(),
        size,
        inter,
        threads,
    )
    return _checked(done, out)


def _checked(done: int, out: torch.Tensor) -> torch.Tensor:
    if not done:  # (the kernel's bookkeeping of its blocks of rows: a few bytes per ~1 MiB of rows)
        raise MemoryError("fused_moe: no memory for the C kernel's row blocks")
    return out


def _layout(weights: PackedExperts) -> ctypes.Array:
    """{bits, group size, groups, padded columns, mins in float32}: moe.c's description of one stack."""
    first = weights.expert(0)
    mins_f32 = int(weights.mins is not None and weights.mins.dtype == torch.float32)
    return (ctypes.c_int64 * 5)(weights.bits, weights.group_size, first.num_groups, first.padded_in_features, mins_f32)


def _pointers(weights: PackedExperts) -> list[int]:
    """The stacked data, scales and mins (0: none), checked to be what moe.c reads."""
    tensors = (weights.data, weights.scales, weights.mins)
    if weights.scales.dtype != torch.float16 or not all(t is None or t.is_contiguous() for t in tensors):
        raise ValueError(
            "fused_moe: quantized experts take contiguous stacked tensors with float16 scales "
            "(build them with pagoda.kernels.quantized.PackedExperts.stack)"
        )
    return [weights.data.data_ptr(), weights.scales.data_ptr(), 0 if weights.mins is None else weights.mins.data_ptr()]

"""The fused mixture-of-experts on the CPU (kernels/cpu/moe.c): routing and grouping in torch (`assign`), then
one C call per layer for the gathered GEMMs, activation and weighted sum, with the experts in panels
(`ExpertPanels`), quantized (`PackedExperts`) or MXFP4 (`Mxfp4Experts`, read as the checkpoint stores them),
and gpt-oss's options (expert biases, clamped SwiGLU) computed in C too. Quantized experts take int8
activations where the dense quantized linears do (`settings.int8_activations`, a CPU with VNNI): each pair's
row is quantized per 32 columns and multiplied by the dense linear's integer tiles. MXFP4 is not repacked into
PackedExperts' layouts: its E2M1 levels are not an affine grid, which INT4's scale * q + min cannot hold, and
INT8 would hold them at twice the bytes."""

from __future__ import annotations

import ctypes

import torch

from pagoda.kernels.cpu.arguments import THREADED_WORK, as_int64, scratch_buffer
from pagoda.kernels.cpu.loader import load, settings
from pagoda.kernels.mxfp4 import Mxfp4Experts
from pagoda.kernels.panels import ExpertPanels
from pagoda.kernels.quantized import PackedExperts
from pagoda.kernels.torch_ref import moe as reference
from pagoda.kernels.torch_ref.moe import Activation, ClampedSwiGLU, ExpertWeights, GeGLU, Routing, assign

_LAYOUTS = (ExpertPanels, PackedExperts, Mxfp4Experts)  # (what moe.c reads; w13 and w2 alike)


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
    """Same contract as `pagoda.kernels.torch_ref.moe.fused_moe`. The C kernel takes float32 tokens on the CPU
    with experts in a layout it reads (`runs_in_c`); anything else runs the reference."""
    lib = load()
    if lib is not None and runs_in_c(hidden, w13, w2, w13_bias, w2_bias):
        assert not isinstance(w13, torch.Tensor) and not isinstance(w2, torch.Tensor)  # (runs_in_c: packed)
        return _fused_moe(
            lib, hidden, router_logits, w13, w2, routing, w13_bias=w13_bias, w2_bias=w2_bias, activation=activation
        )
    return reference.fused_moe(
        hidden, router_logits, w13, w2, routing, w13_bias=w13_bias, w2_bias=w2_bias, activation=activation
    )


def runs_in_c(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> bool:
    """Whether the C kernel computes these tokens and experts (where it builds): float32 tokens on the CPU,
    w13 and w2 both `ExpertPanels`, both `PackedExperts` or both `Mxfp4Experts`, and float32 biases if any
    (plain stacked tensors, and other dtypes, run the reference)."""
    layout = next((kind for kind in _LAYOUTS if isinstance(w13, kind)), None)
    biases = all(b is None or (b.dtype == torch.float32 and b.device.type == "cpu") for b in (w13_bias, w2_bias))
    return (
        layout is not None
        and isinstance(w2, layout)
        and biases
        and hidden.dtype == torch.float32
        and hidden.device.type == "cpu"
    )


def _fused_moe(
    lib,
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: ExpertPanels | PackedExperts | Mxfp4Experts,
    w2: ExpertPanels | PackedExperts | Mxfp4Experts,
    routing: Routing,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Activation | None = None,
) -> torch.Tensor:
    tokens_count, size = hidden.shape
    (experts13, rows13, cols13), (experts2, rows2, inter) = _shape(w13), _shape(w2)
    if (cols13, rows13, rows2, experts13) != (size, 2 * inter, size, experts2):
        raise ValueError(
            f"fused_moe: hidden size {size}, w13 {experts13} x [{rows13}, {cols13}], w2 {experts2} x "
            f"[{rows2}, {inter}]: expected E x [2I, {size}] and E x [{size}, I]"
        )
    biases = [_bias(w13_bias, (experts13, rows13), "w13_bias"), _bias(w2_bias, (experts2, rows2), "w2_bias")]
    act = _activation_floats(activation)
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
    q8_floats = 0  # (int8 activations' workspace, after the float one)
    if isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts):
        layout13, layout2 = _layout(w13), _layout(w2)
        floats = lib["moe_workspace"](
            tokens.numel(), most, size, inter, layout13[3], layout2[3], layout13[2], layout2[2], threads
        )
        if _int8_fits(lib, layout13, layout2):
            q8_floats = lib["moe_q8_workspace"](tokens.numel(), *_q8_layout(layout13), *_q8_layout(layout2))
        name, stacks = "moe_quantized_f32", [*_pointers(w13), layout13, *_pointers(w2), layout2]
    else:
        floats = lib["moe_workspace"](tokens.numel(), most, size, inter, size, inter, 0, 0, threads)
        if isinstance(w13, ExpertPanels) and isinstance(w2, ExpertPanels):
            name, stacks = "moe_f32", [w13.data.data_ptr(), w2.data.data_ptr()]
        else:
            assert isinstance(w13, Mxfp4Experts) and isinstance(w2, Mxfp4Experts)
            name, stacks = "moe_mxfp4_f32", [*_mxfp4(w13), *_mxfp4(w2)]
    # (the options: the bias rows (gpt-oss), then the activation's floats; 0 where absent)
    options = [0 if b is None else b.data_ptr() for b in biases] + [0 if act is None else act.data_ptr()]
    workspace = scratch_buffer(floats + q8_floats)
    buffers = [workspace.data_ptr()]
    if name == "moe_quantized_f32":  # (int8 activations' workspace, or NULL: float activations)
        buffers.append(workspace.data_ptr() + 4 * floats if q8_floats else 0)
    done = lib[name](*common, len(pairs.experts), *stacks, *options, out.data_ptr(), *buffers, size, inter, threads)
    return _checked(done, out)


def _activation_floats(activation: Activation | None) -> torch.Tensor | None:
    """moe.c's `activation` argument: NULL for SiLU-and-mul, else {kind, parameters}: {1, alpha, limit} for
    gpt-oss's clamped SwiGLU, {2} for Gemma 4's GeGLU."""
    if activation is None:
        return None
    if isinstance(activation, ClampedSwiGLU):
        return torch.tensor([1.0, activation.alpha, activation.limit], dtype=torch.float32)
    assert isinstance(activation, GeGLU)
    return torch.tensor([2.0, 0.0, 0.0], dtype=torch.float32)


def int8_activations(lib, w13: ExpertWeights, w2: ExpertWeights) -> bool:
    """Whether `fused_moe` multiplies these experts through int8 activations: both stacks quantized, int8
    activations on (`settings.int8_activations`), the library built with them (a CPU with VNNI) and both
    stacks' groups fitting the integer tiles."""
    if not (isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts)):
        return False
    return _int8_fits(lib, _layout(w13), _layout(w2))


def _int8_fits(lib, layout13: ctypes.Array, layout2: ctypes.Array) -> bool:
    """`int8_activations` for two stacks' `_layout`s."""
    if not settings.int8_activations or not {"moe_q8_workspace", "quantized_q8_supported"} <= lib.keys():
        return False  # (a library built alone, as the ISA-variant tests build moe.c, lacks the check)
    return all(lib["quantized_q8_supported"](layout[2], layout[1], layout[0]) for layout in (layout13, layout2))


def _shape(weights: ExpertPanels | PackedExperts | Mxfp4Experts) -> tuple[int, int, int]:
    """(experts, rows N, columns K) of stacked experts."""
    if isinstance(weights, Mxfp4Experts):
        experts, rows, blocks, _ = weights.blocks.shape
        return experts, rows, blocks * 32
    return weights.num_experts, weights.out_features, weights.in_features


def _bias(bias: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor | None:
    """A bias as moe.c reads it: contiguous float32 [E, N]."""
    if bias is None:
        return None
    if tuple(bias.shape) != shape:
        raise ValueError(f"fused_moe: {name} is {list(bias.shape)}, expected {list(shape)}")
    return bias.contiguous()


def _checked(done: int, out: torch.Tensor) -> torch.Tensor:
    if not done:  # (the kernel's bookkeeping of its blocks of rows: a few bytes per ~1 MiB of rows)
        raise MemoryError("fused_moe: no memory for the C kernel's row blocks")
    return out


def _layout(weights: PackedExperts) -> ctypes.Array:
    """{bits, group size, groups, padded columns, mins in float32}: moe.c's description of one stack."""
    first = weights.expert(0)
    mins_f32 = int(weights.mins is not None and weights.mins.dtype == torch.float32)
    return (ctypes.c_int64 * 5)(weights.bits, weights.group_size, first.num_groups, first.padded_in_features, mins_f32)


def _q8_layout(layout: ctypes.Array) -> tuple[int, int, int]:
    """(padded columns, groups, bits) of a stack: what moe_q8_workspace takes of each."""
    return layout[3], layout[2], layout[0]


def _pointers(weights: PackedExperts) -> list[int]:
    """The stacked data, scales and mins (0: none), checked to be what moe.c reads."""
    tensors = (weights.data, weights.scales, weights.mins)
    if weights.scales.dtype != torch.float16 or not all(t is None or t.is_contiguous() for t in tensors):
        raise ValueError(
            "fused_moe: quantized experts take contiguous stacked tensors with float16 scales "
            "(build them with pagoda.kernels.quantized.PackedExperts.stack)"
        )
    return [weights.data.data_ptr(), weights.scales.data_ptr(), 0 if weights.mins is None else weights.mins.data_ptr()]


def _mxfp4(weights: Mxfp4Experts) -> list[int]:
    """The checkpoint's blocks and scales, read as they are, checked to be what moe.c reads."""
    blocks, scales = weights.blocks, weights.scales
    if not (blocks.is_contiguous() and scales.is_contiguous()) or blocks.shape[:-1] != scales.shape:
        raise ValueError("fused_moe: MXFP4 experts take contiguous blocks [E, N, K / 32, 16] and scales [E, N, K / 32]")
    return [blocks.data_ptr(), scales.data_ptr()]

"""Linears with quantized weights on the CPU (kernels/cpu/quantized_matmul.c): float32 activations times
`pagoda.kernels.quantized.PackedWeight`, by one of four paths chosen by the number of input rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.cpu.arguments import THREADED_WORK, scratch_buffer
from pagoda.kernels.cpu.loader import load, settings
from pagoda.kernels.quantized import PackedWeight, reference_linear

# Which way a quantized linear runs (`path`), by its number of input rows M; crossovers measured on
# SmolLM2's shapes (one thread, against each other and fp32 in the same run), the C paths described in
# quantized_matmul.c:
# - "fused" (1-2 rows; 8-bit: 1-3): every weight block widened in registers once per tile of input
#   rows, scales applied per group; 2-2.6x the fp32 matmul at one row (it reads 1/4-1/8 of the bytes);
# - "batch" (batched decode, from _BATCH_ROWS): register tiles of 6 input rows x 3 weight rows, each
#   weight vector widened and scaled in registers once for the tile's input rows. At 8-16 rows, 1.0-1.3x
#   fp32 for 8-bit weights (per channel: scaled once per output) and 0.95-1.15x for 4-bit groups of 32;
#   up to 64-128 rows it still beats dequantizing for oneDNN;
# - "int8" (where the CPU has VNNI and `settings.int8_activations` is on), every row count below "tiles":
#   input rows quantized to int8 per 32-column block, integer dot products (one VNNI instruction does 4x a
#   float FMA's multiply-adds, and no weight is widened to a float). A row's result depends on that row
#   alone. Against the float paths in the same run (2 threads, weights streamed from memory, 2-core AMD EPYC
#   with AVX-512 VNNI, 2026-12-07, SmolLM2's shapes): 4-bit in groups of 32 at one row 1.1-1.8x "fused",
#   at 16 rows 1.1-1.5x "batch"; 8-bit per channel at one row 0.9-1.1x (already near the memory's speed),
#   at 16 rows 1.2-1.6x;
# - "tiles" (prefill, from _ONEDNN_ROWS): _TILE_FLOATS of dequantized weight at a time, multiplied by
#   oneDNN (this machine's fastest float32 matmul, 2x MKL's here) into the output columns of that tile:
#   its cache blocking wins once the input rows no longer fit the caches beside the weight tile.
_BATCH_ROWS = {4: 3, 8: 4}
_ONEDNN_ROWS = {4: 128, 8: 256}
_TILE_FLOATS = 1 << 17  # 512 KiB of dequantized weight per oneDNN tile
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_tile = torch.empty(0)


def quantized_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `pagoda.kernels.quantized.reference_linear` (float32 activations on the CPU)."""
    lib = load()
    if (
        lib is None
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or packed.data.device.type != "cpu"
        or (bias is not None and bias.dtype != torch.float32)
    ):
        return reference_linear(x, packed, bias)
    return _quantized_linear(lib, x, packed, bias)


@dataclass(frozen=True)
class RowPlan:
    """Which path each row count takes through one packed weight (see the list above): oneDNN tiles from
    `tiles_from` rows on, else int8 activations at every row count where `int8`, else register tiles
    ("batch") from `batch_from`, and below that one row at a time ("fused"). The fused decode step
    (decoder.py) follows the same plan, so both compute the same numbers."""

    int8: bool
    batch_from: int
    tiles_from: int

    def path(self, rows: int) -> str:
        """ "fused", "batch", "int8" or "tiles"."""
        if rows >= self.tiles_from:
            return "tiles"
        if self.int8:
            return "int8"
        return "fused" if rows < self.batch_from else "batch"


def row_plan(lib, packed: PackedWeight) -> RowPlan:
    return RowPlan(_int8_activations_pay(lib, packed), _BATCH_ROWS[packed.bits], _ONEDNN_ROWS[packed.bits])


def path(lib, rows: int, packed: PackedWeight) -> str:
    """How `rows` input rows go through `packed` with `lib`: "fused", "batch", "int8" or "tiles"."""
    return row_plan(lib, packed).path(rows)


def workspace_floats(lib, way: str, rows: int, packed: PackedWeight, threads: int) -> int:
    """Floats of workspace `rows` input rows need through `packed` on C path `way` ("fused", "batch", "int8")."""
    if way == "int8":
        return lib["quantized_q8_workspace"](rows, packed.padded_in_features, packed.num_groups, packed.bits)
    if way == "batch":
        return lib["quantized_batch_workspace"](rows, packed.num_groups, threads)
    return rows * packed.num_groups


def _int8_activations_pay(lib, packed: PackedWeight) -> bool:
    """Whether `packed` goes through int8 activations (below the "tiles" rows): where they are on, the library
    has them (a CPU without VNNI has not) and its groups fit the kernel's layouts."""
    if not settings.int8_activations or "quantized_q8_supported" not in lib:
        return False
    return bool(lib["quantized_q8_supported"](packed.num_groups, packed.group_size, packed.bits))


def mins_in_float32(packed: PackedWeight) -> int:
    """The C kernels read raw pointers to `pagoda.kernels.quantized.pack`'s layout: contiguous float16 scales,
    and mins contiguous in float16 or float32 (this flag tells them which). Checked on every call, cheaply:
    the C code would read anything else as garbage."""
    scales, mins = packed.scales, packed.mins
    if (
        scales.dtype != torch.float16
        or not scales.is_contiguous()
        or (mins is not None and (mins.dtype not in (torch.float16, torch.float32) or not mins.is_contiguous()))
    ):
        raise ValueError(
            f"packed scales {scales.dtype} / mins {None if mins is None else mins.dtype}: the CPU kernel takes "
            "contiguous float16 scales and float16 or float32 mins (build packed weights with "
            "pagoda.kernels.quantized.pack)"
        )
    return int(mins is not None and mins.dtype == torch.float32)


def _quantized_linear(lib, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    mins_f32 = mins_in_float32(packed)
    k, kp, n = packed.in_features, packed.padded_in_features, packed.out_features
    if packed.perm is not None:
        x = x.index_select(-1, packed.perm)
    rows = x.reshape(-1, k)
    if kp != k:  # the kernels read whole 32-column blocks: the padding columns must be zero
        rows = torch.nn.functional.pad(rows, (0, kp - k))
    elif rows.stride(-1) != 1 or rows.stride(0) < kp:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    way = path(lib, m, packed)
    if way == "tiles":
        _tiled_matmul(lib, rows, packed, bias, out, mins_f32)
        return out.reshape(*x.shape[:-1], n)
    threads = torch.get_num_threads() if m * n * kp >= THREADED_WORK else 1
    weight = [
        packed.data.data_ptr(),
        packed.scales.data_ptr(),
        0 if packed.mins is None else packed.mins.data_ptr(),
        0 if bias is None else bias.data_ptr(),
    ]
    sizes = [m, n, kp, packed.num_groups, packed.group_size, packed.bits, rows.stride(0), n]
    workspace = scratch_buffer(workspace_floats(lib, way, m, packed, threads))
    if way == "int8":  # workspace: per-row scales, per-group sums, then the int8 rows
        lib["quantized_linear_q8_f32"](
            rows.data_ptr(), *weight, out.data_ptr(), workspace.data_ptr(), *sizes, threads, mins_f32
        )
    else:
        # (workspace: batch, each thread's output buffer and its chunk's scales and offsets; fused, the group
        # sums of x)
        batched = int(way == "batch")
        lib["quantized_linear_f32"](
            rows.data_ptr(), *weight, out.data_ptr(), workspace.data_ptr(), *sizes, batched, threads, mins_f32
        )
    return out.reshape(*x.shape[:-1], n)


def _matmul_rows(count: int) -> int:
    """Rows a oneDNN matmul runs at: oneDNN builds and caches a primitive (megabytes each) per shape,
    so row counts are rounded to few sizes, as engine_core/layers/linear.py's `onednn_rows` does for the
    float32 linears (the padding rows are zeros, their outputs dropped)."""
    return -(-count // 8) * 8 if count <= 128 else -(-count // 64) * 64


def _tiled_matmul(lib, rows: torch.Tensor, packed: PackedWeight, bias, out: torch.Tensor, mins_f32: int) -> None:
    """out = rows W^T (+ bias), one tile of dequantized weight rows at a time (never all of W)."""
    global _tile
    kp, n, m = packed.padded_in_features, packed.out_features, rows.shape[0]
    step = max(16, _TILE_FLOATS // kp // 16 * 16)
    if _tile.numel() < step * kp:
        _tile = torch.empty(step * kp, dtype=torch.float32)
    if _ONEDNN and _matmul_rows(m) != m:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, _matmul_rows(m) - m))
    threads = torch.get_num_threads()
    for start in range(0, n, step):
        stop = min(start + step, n)
        w = _tile[: (stop - start) * kp].view(stop - start, kp)
        lib["quantized_dequantize_f32"](
            packed.data.data_ptr(),
            packed.scales.data_ptr(),
            0 if packed.mins is None else packed.mins.data_ptr(),
            w.data_ptr(),
            n,
            kp,
            packed.num_groups,
            packed.group_size,
            packed.bits,
            start,
            stop,
            threads,
            mins_f32,
        )
        b = None if bias is None else bias[start:stop]
        if _ONEDNN:
            out[:, start:stop] = torch.ops.mkldnn._linear_pointwise(rows, w, b, "none", [], "")[:m]
        elif b is None:
            torch.mm(rows, w.t(), out=out[:, start:stop])
        else:
            torch.addmm(b, rows, w.t(), out=out[:, start:stop])

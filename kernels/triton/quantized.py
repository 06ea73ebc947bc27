"""Weight-only quantized linear layers on CUDA: a Triton W4A16 / W8A16 GEMM over `PackedWeight`.

Same contract and signature as `pagoda.kernels.quantized.reference_linear`: `y = x W^T (+ bias)`, where W is
held packed (4-bit GGUF block order or 8-bit q - 128, float16 scales and float16 or float32 mins
`[N, G]`, optional act-order `perm`; see kernels/quantized.py). The weight is never dequantized to
memory: each program reads its packed tile, turns the integers into the activation dtype (exactly: they
are at most 8 bits; see `_exact_float`) and multiplies them with `tl.dot` into a fresh fp32 tile, then
applies the group's scale and min (converted to fp32 as they are loaded) to that tile:

    sum_k x[m, k] (scale[n, g] q[n, k] + min[n, g]) = scale[n, g] (x . q)[m, n] + min[n, g] sum_k x[m, k]

(for 8 bits q is the stored q - 128 and min the offset min + 128 * scale, as in kernels/quantized.py)

so the scales cost two multiply-adds per output element per K-tile instead of one per weight, and no
rounding of a dequantized weight enters the result. A K-tile therefore never straddles two groups:
BLOCK_K divides the group size (every group size is a multiple of 32), or is free when a row has one
group. A 4-bit tile of BLOCK_K columns is BLOCK_K / 2 bytes per row; each byte's low nibbles meet the
activations of columns j and its high nibbles those of j + 16 of its 32-column block, as two dots.

Small M (decode) is weight-bandwidth bound and has few output tiles, so K is split over more programs
(grid: M tiles x N tiles x K splits) until the GPU is full; the splits write fp32 partials that a
second kernel sums (deterministic, no zero-fill or atomics) while adding the bias and casting. Every
decision depends only on shapes and the device, never on data, so a call can be captured in a CUDA
graph. With act-order the activation columns are permuted once (`index_select`) before the kernel.
Tile sizes are fixed per M class (no autotuning).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from pagoda.kernels.quantized import BLOCK, PackedWeight
from pagoda.kernels.triton.attention import _dot_precision, _num_sms

_PROGRAMS_PER_SM = 2  # split K until about this many programs per SM (decode is memory-bound: more hides latency)
_MAX_SPLITS = 32  # the reduce reads every split's partial tile; beyond this the GPU is full anyway
_REDUCE_BLOCK_N = 256


@triton.jit
def _exact_float(u, SUBTRACT: tl.constexpr, dtype: tl.constexpr):
    """`u - SUBTRACT` in `dtype` for unsigned integers `u` (< 16 in bf16, < 256 otherwise), exactly and
    without integer-to-float conversion instructions, which run at a fraction of the FP rate and would
    cap decode below the memory bandwidth: OR'ing u into the mantissa of a power of two P (that has
    enough mantissa bits) gives the float P + u, and subtracting P + SUBTRACT leaves the value."""
    if dtype == tl.float16:  # P = 1024 = 0x6400: 10 mantissa bits
        value = (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024 + SUBTRACT)
    elif dtype == tl.bfloat16:  # P = 128 = 0x4300: 7 mantissa bits
        value = (u.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - (128 + SUBTRACT)
    else:  # float32, P = 2**23 = 0x4B000000
        value = (u.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608 + SUBTRACT)
    return value.to(dtype)


# Runtime sizes that change from call to call (rows) or only pick loop bounds are not specialized on
# (divisibility by 16, equality to 1): each specialization is another compile, for no faster code.
@triton.jit(do_not_specialize=["M", "stride_sn", "stride_sg", "group_size", "num_k_tiles", "tiles_per_split"])
def _quantized_gemm_kernel(
    x_ptr,
    w_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_om,
    group_size,
    num_k_tiles,
    tiles_per_split,
    BITS: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (M tile, N tile, K split): out[m, n] over this split's K tiles. PARTIAL: fp32 partial sums
    into `out_ptr` `[splits, M, N]` (contiguous), without bias; else the final values in out's dtype."""
    pid_m = tl.program_id(0)  # fastest: programs sharing one weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    s_rows = scales_ptr + n.to(tl.int64) * stride_sn
    min_rows = mins_ptr + n.to(tl.int64) * stride_sn
    compute_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_k_tiles)
    for tile in range(tile_lo, tile_hi):
        k0 = tile * BLOCK_K
        if BITS == 4:
            # Byte b of the tile: block b // 16 of 32 columns, low nibble = column b % 16, high = + 16.
            b = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (b // 16) * 32 + b % 16
            k_hi = k_lo + 16
            packed = tl.load(w_rows + (k0 // 2 + b)[None, :], mask=n_mask[:, None] & (k_lo < K)[None, :], other=0)
            q_lo = _exact_float(packed & 15, 0, compute_dtype)
            q_hi = _exact_float(packed >> 4, 0, compute_dtype)
            x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=m_mask[:, None] & (k_lo < K)[None, :], other=0.0)
            x_hi = tl.load(x_rows + k_hi[None, :] * stride_xk, mask=m_mask[:, None] & (k_hi < K)[None, :], other=0.0)
            dot = tl.dot(x_lo, tl.trans(q_lo), input_precision=DOT_PRECISION)
            dot = tl.dot(x_hi, tl.trans(q_hi), dot, input_precision=DOT_PRECISION)
            if HAS_MINS:
                x_sum = tl.sum(x_lo.to(tl.float32), 1) + tl.sum(x_hi.to(tl.float32), 1)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            stored = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0)
            # q - 128 as stored; its bits ^ 0x80 are q in [0, 256): too wide for bf16's mantissa, so
            # bf16 goes through float32 (one float-to-float conversion).
            q = stored.to(tl.uint8, bitcast=True) ^ 0x80
            if compute_dtype == tl.bfloat16:
                q = _exact_float(q, 128, tl.float32).to(tl.bfloat16)
            else:
                q = _exact_float(q, 128, compute_dtype)
            x = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            dot = tl.dot(x, tl.trans(q), input_precision=DOT_PRECISION)
            if HAS_MINS:
                x_sum = tl.sum(x.to(tl.float32), 1)
        group = k0 // group_size
        scale = tl.load(s_rows + group * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        acc += dot * scale[None, :]
        if HAS_MINS:
            group_min = tl.load(min_rows + group * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
            if BITS == 8:  # the stored integer is q - 128: the offset is min + 128 * scale
                group_min = group_min + 128.0 * scale
            acc += x_sum[:, None] * group_min[None, :]

    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        offsets = (split * M + m[:, None]).to(tl.int64) * N + n[None, :]
        tl.store(out_ptr + offsets, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        offsets = m[:, None].to(tl.int64) * stride_om + n[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _split_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    num_splits,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (row, N block): out[row, n] = sum over splits of the fp32 partials (+ bias), in out's dtype."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for split in range(num_splits):
        acc += tl.load(partial_ptr + (split * M + row).to(tl.int64) * N + n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def _block_k(preferred: int, packed: PackedWeight) -> int:
    """The K-tile: `preferred` when a row has one group, else the largest power of two up to it that
    divides the group size (at least BLOCK = 32, which every group size is a multiple of)."""
    if packed.num_groups == 1:
        return preferred
    block_k = preferred
    while packed.group_size % block_k:
        block_k //= 2
    return max(block_k, BLOCK)


def _launch_shape(rows: int, packed: PackedWeight, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, K splits, K tiles per split), from shapes only (graph-safe).

    Up to 16 rows (decode): one 16-row tile (tl.dot's minimum), 64 output columns, long K tiles, and K
    split until the grid holds `_PROGRAMS_PER_SM` programs per SM. Larger M: bigger tiles for weight
    reuse; K is split only while the output tiles alone leave the GPU underfilled."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 128 if block_m >= 64 else 64
    block_k = _block_k(128 if block_m <= 16 else 64, packed)
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    num_k_tiles = triton.cdiv(packed.in_features, block_k)
    programs = triton.cdiv(rows, block_m) * triton.cdiv(packed.out_features, block_n)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), programs)
    splits = max(1, min(wanted, num_k_tiles, _MAX_SPLITS))
    tiles_per_split = triton.cdiv(num_k_tiles, splits)
    splits = triton.cdiv(num_k_tiles, tiles_per_split)  # no split left without a tile
    return block_m, block_n, block_k, num_warps, splits, tiles_per_split


def quantized_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for `x` `[..., K]` in fp32, fp16 or bf16; returns `[..., N]` in x's dtype."""
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight takes {packed.in_features}")
    if packed.bits not in (4, 8):
        raise ValueError(f"{packed.bits}-bit weights are not supported: use 4 or 8")
    if packed.perm is not None:
        x = x.index_select(-1, packed.perm)
    rows = x.reshape(-1, packed.in_features)
    num_rows, n = rows.shape[0], packed.out_features
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    block_m, block_n, block_k, num_warps, splits, tiles_per_split = _launch_shape(num_rows, packed, x.device)
    partial = splits > 1
    target = torch.empty(splits, num_rows, n, dtype=torch.float32, device=x.device) if partial else out
    scales = packed.scales
    mins = packed.mins if packed.mins is not None else scales  # a pointer never read without HAS_MINS
    if mins.stride() != scales.stride() or packed.data.stride(-1) != 1:
        raise ValueError("the packed data must have contiguous rows, and scales and mins one layout")
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n), splits)
    _quantized_gemm_kernel[grid](
        rows,
        packed.data,
        scales,
        mins,
        out if bias is None else bias,  # bias: never read without HAS_BIAS
        target,
        num_rows,
        n,
        packed.in_features,
        rows.stride(0),
        rows.stride(1),
        packed.data.stride(0),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        packed.group_size,
        triton.cdiv(packed.in_features, block_k),
        tiles_per_split,
        BITS=packed.bits,
        HAS_MINS=packed.mins is not None,
        HAS_BIAS=bias is not None,
        PARTIAL=partial,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=num_warps,
    )
    if partial:
        _split_reduce_kernel[(num_rows, triton.cdiv(n, _REDUCE_BLOCK_N))](
            target,
            out if bias is None else bias,
            out,
            num_rows,
            n,
            splits,
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_N=_REDUCE_BLOCK_N,
            num_warps=4,
        )
    return out.reshape(*x.shape[:-1], n)


__all__ = ["quantized_linear"]

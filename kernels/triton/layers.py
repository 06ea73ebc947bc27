"""Triton kernels for the element-wise and normalization ops of `pagoda.kernels.torch_ref.layers`.

Same signatures and results as the references. Math is in float32, but where the reference rounds an
intermediate to the tensor's dtype (bf16/fp16) the kernels round at the same points, so low-precision
results track Hugging Face's float math rather than merely being close to it.

Memory contracts (callers must use the return values either way):
- `rms_norm` and `silu_and_mul` write fresh outputs.
- `fused_add_rms_norm` works in place: the new residual goes into `residual`'s storage and the normed
  value into `x`'s. `x` and `residual` must not overlap.
- `rotary_embedding` rotates `query` and `key` in place (any strides) and returns them.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round float32 `x` to `dtype` and back: marks where the reference rounds (no-op for float32)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    w_ptr,
    n_inner,
    x_s0,
    x_s1,
    r_s0,
    r_s1,
    o_s0,
    o_s1,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row. Rows are indexed as [outer, inner] so a [T, heads, D] view of a fused QKV
    # output (the q/k norms) needs no copy: row r is (r // n_inner, r % n_inner).
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // n_inner, row % n_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_ptrs = x_ptr + outer * x_s0 + inner * x_s1 + cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + outer * r_s0 + inner * r_s1 + cols
        # The reference adds in x's dtype; the rounded sum is both the new residual and the norm input.
        x = _round(x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(res_ptrs, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)  # masked columns loaded as 0: sum unaffected
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Reference order: normalize in float32, round to x's dtype, then multiply by the weight.
    y = _round(x * rstd, dtype) * w
    tl.store(out_ptr + outer * o_s0 + inner * o_s1 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_s0, o_s0, BLOCK: tl.constexpr):
    # Grid: (rows, column blocks). Rows go on axis 0, whose limit (2^31 - 1) fits any batch.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_s0 + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_s0 + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds to the dtype before the multiply; exp(-gate) -> inf for very negative gate gives -0.
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * o_s0 + cols, (silu * up).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(
    ptr,
    token,
    head0,
    n_heads,
    s0,
    s1,
    s2,
    cos,
    sin,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate heads [head0, head0 + BLOCK_H) of one token of a [T, heads, D] tensor in place."""
    heads = head0 + tl.arange(0, BLOCK_H)
    pair = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (pair < half)[None, :]
    if IS_NEOX:  # pairs (i, i + half): the two halves of the rotary dims
        d1, d2 = pair, pair + half
    else:  # GPT-J: pairs (2i, 2i + 1)
        d1, d2 = 2 * pair, 2 * pair + 1
    base = ptr + token * s0 + heads[:, None] * s1
    p1, p2 = base + d1[None, :] * s2, base + d2[None, :] * s2
    dtype = ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # The reference computes in the tensor's dtype: every product and sum is rounded there.
    o1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    o2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    tl.store(p1, o1.to(dtype), mask=mask)
    tl.store(p2, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    n_q_heads,
    n_k_heads,
    q_s0,
    q_s1,
    q_s2,
    k_s0,
    k_s1,
    k_s2,
    cache_s0,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Grid: (tokens, head blocks). The token's cos/sin row is loaded once and used for a block of q
    # heads and the same block of k heads (a no-op past the last k head). Dims >= 2 * half are never
    # touched: that is partial rotary.
    token = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    pair = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cache_row = cache_ptr + pos * cache_s0
    # The reference casts cos/sin to the query's dtype first.
    dtype = q_ptr.dtype.element_ty
    cos = _round(tl.load(cache_row + pair, mask=pair < half, other=0.0).to(tl.float32), dtype)[None, :]
    sin = _round(tl.load(cache_row + half + pair, mask=pair < half, other=0.0).to(tl.float32), dtype)[None, :]
    _rotate_heads(q_ptr, token, head0, n_q_heads, q_s0, q_s1, q_s2, cos, sin, half, IS_NEOX, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, token, head0, n_k_heads, k_s0, k_s1, k_s2, cos, sin, half, IS_NEOX, BLOCK_H, BLOCK_HALF)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """`[..., H]` -> a `[outer, inner, H]` view with unit stride on H; copies only when no view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x[None, None]
    if x.dim() == 2:
        return x[:, None]
    return x.reshape(-1, *x.shape[-2:])


def _norm_warps(block: int) -> int:
    """1 warp per 256 columns, 1 to 8: 128-wide q/k norms get one warp, hidden 4096+ gets eight."""
    return min(max(block // 256, 1), 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of `x` `[..., H]`, into a fresh tensor of
    x's dtype. `x` may be a strided view (e.g. `[T, heads, D]` sliced from a fused QKV output)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    hidden = x.shape[-1]
    x3 = _as_rows(x)
    o3 = out.view(x3.shape)  # same [outer, inner] row indexing as x3
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        x3,
        o3,
        weight.contiguous(),
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        0,
        0,
        o3.stride(0),
        o3.stride(1),
        hidden,
        eps,
        HAS_RESIDUAL=False,
        BLOCK=block,
        num_warps=_norm_warps(block),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass, IN PLACE: the sum is written into `residual`'s
    storage and the normed value into `x`'s (a copy's, if either lacks a unit stride on its last dim);
    returns those two tensors. `x` and `residual` must have the same shape and not overlap."""
    if x.numel() == 0:
        return x, residual
    hidden = x.shape[-1]
    x3, r3 = _as_rows(x), _as_rows(residual)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        r3,
        x3,
        weight.contiguous(),
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        x3.stride(0),
        x3.stride(1),
        hidden,
        eps,
        HAS_RESIDUAL=True,
        BLOCK=block,
        num_warps=_norm_warps(block),
    )
    # Views of the originals unless _as_rows had to copy.
    return x3.reshape(x.shape), r3.reshape(residual.shape)


_SILU_BLOCK = 1024  # columns per program: 8 per thread at 4 warps


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., 2I]` holding gate and up halves -> silu(gate) * up `[..., I]`, a fresh tensor."""
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, inter)
    grid = (x2.shape[0], triton.cdiv(inter, _SILU_BLOCK))
    _silu_and_mul_kernel[grid](x2, o2, inter, x2.stride(0), o2.stride(0), BLOCK=_SILU_BLOCK, num_warps=4)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` `[T, H, D]` and `key` `[T, Hkv, D]` IN PLACE by their `positions` `[T]`; returns them.

    Both may be strided views (e.g. of a fused QKV output) and must share a dtype. `cos_sin_cache`
    `[max_pos, rot_dim]` holds cos in its first half and sin in its second; dims past rot_dim are left
    as they are. Neox style rotates the two halves of the rotary dims, GPT-J style even/odd pairs.
    """
    if query.dtype != key.dtype:
        raise ValueError(f"query and key dtypes differ: {query.dtype} vs {key.dtype}")
    tokens = query.shape[0]
    if tokens == 0:
        return query, key
    half = cos_sin_cache.shape[-1] // 2
    cache = cos_sin_cache.contiguous()
    positions = positions.contiguous()
    block_half = triton.next_power_of_2(half)
    max_heads = max(query.shape[1], key.shape[1])
    # About 2K elements per tensor per program: all heads of a small model in one program, without
    # spilling registers on 64-head models.
    block_h = min(triton.next_power_of_2(max_heads), max(2048 // block_half, 1))
    grid = (tokens, triton.cdiv(max_heads, block_h))
    _rotary_kernel[grid](
        positions,
        query,
        key,
        cache,
        query.shape[1],
        key.shape[1],
        *query.stride(),
        *key.stride(),
        cache.stride(0),
        half,
        IS_NEOX=is_neox_style,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return query, key

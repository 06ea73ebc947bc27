"""Variable-length attention with no KV cache in Triton: pooling models run each prompt whole in one step,
so the keys and values are this step's own rows, causal (decoder embedders) or bidirectional (encoders).

Same contract and signature as `pagoda.kernels.torch_ref.attention.varlen_attention`. Like the paged prefill
kernel (kernels/triton/attention.py), one program serves a tile of query tokens times every query head
of one KV head (each K/V tile read once per group), with fp32 online softmax (exp2, log2(e) folded into
the scale); K/V are read straight from the strided [T, Hkv, D] projections.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from pagoda.kernels.triton.attention import (
    _LOG2E,
    _NO_WINDOW,
    _NUM_WARPS,
    _dot_precision,
    _online_softmax_step,
    _soft_cap,
    _softcap_arguments,
)


@triton.jit
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_index_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    window,
    head_dim,
    softcap,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (query tile, kv head): TOKENS_PER_TILE tokens x the GROUP heads of one KV head, as rows
    (token-major), flash attention over the key tiles some row can see."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_tile = tl.load(tile_index_ptr + tile)
    start = tl.load(query_start_loc_ptr + seq)
    seq_len = (tl.load(query_start_loc_ptr + seq + 1) - start).to(tl.int32)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    token = q_tile * TOKENS_PER_TILE + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < TOKENS_PER_TILE * GROUP) & (token < seq_len)
    d_mask = d < head_dim
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0
    )

    first_token = q_tile * TOKENS_PER_TILE
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, seq_len) - 1
    if CAUSAL:
        kv_lo = tl.maximum(first_token - window + 1, 0)
        kv_hi = last_token + 1
    else:
        kv_lo = 0
        kv_hi = seq_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kv_tile_start in range((kv_lo // BLOCK_N) * BLOCK_N, kv_hi, BLOCK_N):
        pos = kv_tile_start + n
        in_range = (pos >= kv_lo) & (pos < kv_hi)
        kv_mask = in_range[:, None] & d_mask[None, :]
        rows = (start + pos).to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        visible = in_range[None, :] & row_mask[:, None]
        if CAUSAL:
            visible = visible & (pos[None, :] <= token[:, None]) & (pos[None, :] > token[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on padding rows, which are not stored
    tl.store(
        out_ptr + (start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention within each whole sequence of a varlen batch (see the torch reference). Reads
    `query_start_loc` on the host to size the grid (a sync: pooling steps run eagerly)."""
    if sinks is not None:  # (attention sinks, gpt-oss: this kernel has no sink term, the torch reference runs)
        from pagoda.kernels.torch_ref import attention as reference

        return reference.varlen_attention(
            query, key, value, query_start_loc, scale, causal, sliding_window, out=out, sinks=sinks, softcap=softcap
        )
    if sliding_window is not None and not causal:
        raise ValueError("a sliding window applies to causal attention only")
    if any(x.stride(-1) != 1 for x in (query, key, value)):
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    _tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    block_m = max(64, triton.next_power_of_2(group))
    tokens_per_tile = block_m // group

    # One program per (sequence, tile of query tokens); the heaviest first (causal: the late tiles see
    # the most keys; bidirectional: the longest sequences), so they do not start last.
    lens = query_start_loc.diff().cpu()
    tiles = (lens + tokens_per_tile - 1) // tokens_per_tile
    tile_seq = torch.repeat_interleave(torch.arange(len(lens)), tiles)
    if len(tile_seq) == 0:
        return out
    tile_index = torch.arange(len(tile_seq)) - (tiles.cumsum(0) - tiles)[tile_seq]
    work = tile_index * tokens_per_tile if causal else lens[tile_seq]
    order = torch.argsort(work, descending=True, stable=True)
    tile_seq = tile_seq[order].to(device=query.device, dtype=torch.int32)
    tile_index = tile_index[order].to(device=query.device, dtype=torch.int32)

    _varlen_kernel[(len(tile_seq), num_kv_heads)](
        query,
        key,
        value,
        out,
        query_start_loc,
        tile_seq,
        tile_index,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        sliding_window or _NO_WINDOW,
        head_dim,
        **_softcap_arguments(softcap),
        CAUSAL=causal,
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=_NUM_WARPS if head_dim <= 128 else 2 * _NUM_WARPS,
    )
    return out

"""Paged attention in Triton: cache writes, split-K ("flash-decoding") decode and varlen causal prefill.

Same contracts and signatures as `pagoda.kernels.torch_ref.attention`. Cache layout (per layer): `key_cache` /
`value_cache` `[num_blocks, block_size, num_kv_heads, head_dim]`; token p of sequence b lives in block
`block_tables[b, p // block_size]`, row `p % block_size`.

Both attention kernels are GQA-aware: one program serves every query head of one KV head, so each K/V
tile is read once per group. Scores, softmax statistics and accumulators are fp32 (exp2 with log2(e)
folded into the scale); outputs take the query's dtype. Attention logit soft-capping (Gemma 2: `softcap`,
0 = off) caps each scaled score s to softcap * tanh(s / softcap) before the mask (`_soft_cap`). Tile sizes
are fixed (no autotuning) and only long-stable `triton.language` APIs are used.
"""

from __future__ import annotations

import functools

import torch

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # a "sliding window" longer than any sequence: one code path with or without a window
_MAX_SPLITS = 64  # the decode reduce holds all of one head's split partials in registers at once
_PROGRAMS_PER_SM = 2  # decode aims at this many programs per SM (it is memory-bound: more hides latency)
_NUM_WARPS = 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter (CPU tensors): use the H100/H200 count so tests exercise the same rule


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run through TF32 tensor cores (~1e-3 error); the option is ignored for 16-bit.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("key/value caches must share strides and have a contiguous head_dim")


def _output(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must match the query's shape and dtype, with a contiguous head_dim")
    return out


def _attention_inputs(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Checked inputs of both attention kernels: (query with a contiguous head_dim, the output buffer,
    (rows, num_heads, head_dim, block_size, num_kv_heads, query heads per KV head))."""
    _check_cache(key_cache, value_cache)
    rows, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    return query, _output(out, query), (rows, num_heads, head_dim, block_size, num_kv_heads, num_heads // num_kv_heads)


# ---- reshape_and_cache ------------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # slot < 0: a padding token, nothing to write
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch + dims
        tl.store(key_cache_ptr + dst, k, mask=mask)
        tl.store(value_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into the cache slots `slot_mapping` `[T]`; slots < 0 are skipped."""
    _check_cache(key_cache, value_cache)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=_NUM_WARPS,
    )


# ---- shared attention pieces --------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_row_ptr,
    pos,
    load_mask,
    d,
    d_mask,
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V `[BLOCK_N, BLOCK_D]` for token positions `pos` of one sequence (whose block-table row is
    `block_row_ptr`); masked tokens read nothing and come back as 0, so never-written slots stay out."""
    block = tl.load(block_row_ptr + pos // BLOCK_SIZE, mask=load_mask, other=0).to(tl.int64)
    rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    offsets = rows[:, None] + d[None, :]
    mask = load_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return k, v


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap) (scores and cap both log2-scaled: the same as capping before the scaling), with
    tanh(x) = 2 sigmoid(2x) - 1 (`triton.language` has no tanh of its own)."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


def _softcap_arguments(softcap: float) -> dict:
    """The kernels' soft-capping arguments: the cap log2-scaled like the scores, and whether to apply it."""
    return {"softcap": softcap * _LOG2E if softcap else 1.0, "SOFTCAP": bool(softcap)}


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of log2-scaled scores `s` (masked entries -inf) and its values into the running
    row max `m_i`, row sum `l_i` and unnormalised output `acc`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key keeps m = -inf; shifting by 0 then makes every exp2 exactly 0
    # instead of NaN (-inf - -inf).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ---- decode -------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    qk_scale,
    window,
    num_heads,
    num_splits,
    head_dim,
    softcap,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (sequence, kv head, split): the GROUP query heads of one KV head over this split's share
    of the sequence's visible key tiles; writes partial (max, sum, acc) per head, neutral if no work."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    kv_start = tl.maximum(seq_len - window, 0)  # first key visible to the query at position seq_len - 1
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile  # 0 for a seq_len-0 padding row
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    g = tl.arange(0, BLOCK_G)  # query heads of the group, padded to >= 16 rows for tl.dot
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + n
        visible = (pos >= kv_start) & (pos < seq_len)
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq * stride_bt,
            pos,
            visible,
            d,
            d_mask,
            kv_head,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    part = (seq * num_heads + head) * num_splits + split  # partials are contiguous [B, H, splits(, D)]
    tl.store(part_m_ptr + part, m_i, mask=g_mask)
    tl.store(part_l_ptr + part, l_i, mask=g_mask)
    tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (sequence, head): combine the split partials into the normalised output."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    part = (seq * num_heads + head) * num_splits + s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    row_sum = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (seq_len 0): all weights 0
    weight = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(weight * row_sum, 0)
    o = tl.sum(weight[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)  # seq_len 0 -> zeros
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def _decode_num_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU, but never more than the longest
    sequence has key tiles. Depends on shapes and host ints only, so it is fixed under CUDA-graph capture."""
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_len, block_n), _MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence: `query` `[B, H, D]` attends to the sequence's first `seq_lens[b]`
    cached tokens (its own K/V already written). Returns `[B, H, D]` (into `out` if given).

    No host syncs (CUDA-graph safe). `max_seq_len` only sizes the split count; results are correct for any
    `seq_lens[b] <= block_tables.shape[1] * block_size` whatever it says. seq_len-0 rows give zeros."""
    if sinks is not None:  # (attention sinks, gpt-oss: this kernel has no sink term, the torch reference runs)
        from pagoda.kernels.torch_ref import attention as reference

        return reference.paged_decode_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale,
            sliding_window,
            max_seq_len,
            out=out,
            sinks=sinks,
            softcap=softcap,
        )
    query, out, shape = _attention_inputs(query, key_cache, value_cache, out)
    batch, num_heads, head_dim, block_size, num_kv_heads, group = shape
    if batch == 0:
        return out
    block_n = 64 if head_dim <= 128 else 32
    max_len = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    num_splits = _decode_num_splits(batch, num_kv_heads, max_len, block_n, query.device)
    part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        part_m,
        part_l,
        part_acc,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        scale * _LOG2E,
        sliding_window or _NO_WINDOW,
        num_heads,
        num_splits,
        head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        **_softcap_arguments(softcap),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=_NUM_WARPS,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_m,
        part_l,
        part_acc,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )
    return out


# ---- prefill ------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    tile_seq_ptr,
    tile_index_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    qk_scale,
    window,
    head_dim,
    softcap,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (query tile, kv head): TOKENS_PER_TILE query tokens x the GROUP heads of one KV head, packed
    as rows (token-major), flash-attention over the key tiles that some row can see."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_tile = tl.load(tile_index_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    context = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len  # position of the chunk's first token

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    token = q_tile * TOKENS_PER_TILE + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < TOKENS_PER_TILE * GROUP) & (token < q_len)
    d_mask = d < head_dim
    q_pos = context + token
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0
    )

    # Keys some row can see: from the first row's window start to the last row's own position.
    first_token = q_tile * TOKENS_PER_TILE
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, q_len) - 1
    kv_lo = tl.maximum(context + first_token - window + 1, 0)
    kv_hi = context + last_token + 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kv_tile_start in range((kv_lo // BLOCK_N) * BLOCK_N, kv_hi, BLOCK_N):
        pos = kv_tile_start + n
        in_range = (pos >= kv_lo) & (pos < kv_hi)
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + seq * stride_bt,
            pos,
            in_range,
            d,
            d_mask,
            kv_head,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on padding rows, which are not stored
    tl.store(
        out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention for a variable-length batch of query chunks over a paged prefix.

    Sequence b owns query rows `query_start_loc[b]:query_start_loc[b+1]`, which are its last tokens:
    positions `seq_lens[b] - q_len .. seq_lens[b] - 1`. All of its K/V (prefix + the new tokens) are
    already in the cache. `query` `[T, H, D]` -> `[T, H, D]` (into `out` if given). Reads
    `query_start_loc` and `seq_lens` on the host to size the grid (a sync: prefill runs eagerly)."""
    if sinks is not None:  # (attention sinks, gpt-oss: this kernel has no sink term, the torch reference runs)
        from pagoda.kernels.torch_ref import attention as reference

        return reference.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
            out=out,
            sinks=sinks,
            softcap=softcap,
        )
    query, out, shape = _attention_inputs(query, key_cache, value_cache, out)
    _num_tokens, _num_heads, head_dim, block_size, num_kv_heads, group = shape
    block_m = max(64, triton.next_power_of_2(group))
    tokens_per_tile = block_m // group

    # The grid: one program per (sequence, tile of tokens_per_tile query tokens), heaviest first so the
    # long causal tails do not start last.
    q_lens = query_start_loc.diff().cpu()
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_seq = torch.repeat_interleave(torch.arange(len(q_lens)), tiles)
    if len(tile_seq) == 0:
        return out
    tile_index = torch.arange(len(tile_seq)) - (tiles.cumsum(0) - tiles)[tile_seq]
    work = (seq_lens.cpu() - q_lens)[tile_seq] + tile_index * tokens_per_tile
    order = torch.argsort(work, descending=True, stable=True)
    tile_seq = tile_seq[order].to(device=query.device, dtype=torch.int32)
    tile_index = tile_index[order].to(device=query.device, dtype=torch.int32)

    _prefill_kernel[(len(tile_seq), num_kv_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        tile_seq,
        tile_index,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        scale * _LOG2E,
        sliding_window or _NO_WINDOW,
        head_dim,
        GROUP=group,
        BLOCK_SIZE=block_size,
        **_softcap_arguments(softcap),
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=_NUM_WARPS if head_dim <= 128 else 2 * _NUM_WARPS,
    )
    return out

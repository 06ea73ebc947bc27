"""Attention over the paged KV cache, in plain torch.

Cache layout (per layer): key_cache / value_cache `[num_blocks, block_size, num_kv_heads, head_dim]`;
a sequence's token at position p lives in block `block_table[p // block_size]`, row `p % block_size`.
The cache may hold a narrower dtype than the queries (`--kv-cache-dtype float16`): values are rounded
to it when written and read back in the queries' dtype.

`sinks` (optional, `[H]`): a learned logit per query head that joins each row's softmax denominator and
attends to nothing (gpt-oss's attention sinks): the row's weights then sum to less than one.

`softcap` (optional, 0 = off): attention logit soft-capping (Gemma 2): each scaled score s becomes
softcap * tanh(s / softcap) before the mask and the softmax, as Hugging Face's eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into the cache slots `slot_mapping` `[T]`; slots < 0 are skipped."""
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_sequences(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """`[B, max_len, Hkv, D]` view of each sequence's cached tokens in `dtype` (rows past its length are
    junk)."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    batch = block_tables.shape[0]
    # index_select over a flat index copies whole blocks; advanced indexing with a 2-D index is ~5x slower.
    gathered = cache.index_select(0, block_tables[:, :num_blocks].reshape(-1)).to(dtype)
    return gathered.view(batch, num_blocks * block_size, *cache.shape[2:])[:, :max_len]


def _key_mask(
    query_pos: torch.Tensor, seq_lens: torch.Tensor, max_len: int, sliding_window: int | None
) -> torch.Tensor:
    """Boolean `[B, Q, max_len]`: key j is visible to the query at position p iff j <= p (and within
    the sliding window) and j < seq_len."""
    key_pos = torch.arange(max_len, device=seq_lens.device)
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    return visible


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    causal: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of `q` `[B, H, Q, D]` over `k` / `v` `[B, Hkv, L, D]` under the boolean `mask` (broadcast
    to `[B, H, Q, L]`; None: all keys, or causal if `causal`). Without sinks or soft-capping torch's fused
    kernel; with either the scores are written out (as HF's eager gpt-oss and Gemma 2 attention), since the
    fused kernel has neither."""
    if sinks is None and not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # (the sink's share dropped)
    return torch.matmul(probs.to(v.dtype), v)


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
    cached tokens (its own K/V already written). Returns `[B, H, D]` (written into `out` if given).
    `sinks`, `softcap`: see the module docstring.
    Batched, no per-sequence loop. `max_seq_len` (= max(seq_lens)) saves a device sync when the caller knows it."""
    batch, num_heads, head_dim = query.shape
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    keys = _gather_sequences(key_cache, block_tables, max_len, query.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    values = _gather_sequences(value_cache, block_tables, max_len, query.dtype).transpose(1, 2)
    mask = _key_mask((seq_lens - 1)[:, None], seq_lens, max_len, sliding_window)  # [B, 1, L]
    # Rows past a sequence's end are never-written cache memory: zero them, or NaN there poisons the sum.
    hidden = ~mask[:, :, :, None]  # [B, 1, L, 1], broadcast over kv heads and head_dim
    keys, values = keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0)
    result = _sdpa(query[:, :, None, :], keys, values, mask[:, None], scale, sinks, softcap=softcap).view(
        batch, num_heads, head_dim
    )
    if out is None:
        return result
    out.copy_(result)
    return out


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
    already in the cache. `query` `[T, H, D]` -> `[T, H, D]` (written into `out` if given). `sinks`,
    `softcap`: see the module docstring.
    """
    out = torch.empty_like(query) if out is None else out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):  # prefill chunks are few and large: a loop over them costs nothing
        start, end, seq_len = starts[b], starts[b + 1], lens[b]
        q_len = end - start
        # 4-D [1, heads, len, D] inputs: torch's CPU flash kernel takes them (3-D falls back to math).
        keys = _gather_sequences(key_cache, block_tables[b : b + 1], seq_len, query.dtype).transpose(1, 2)
        values = _gather_sequences(value_cache, block_tables[b : b + 1], seq_len, query.dtype).transpose(1, 2)
        q = query[None, start:end].transpose(1, 2)
        if q_len == seq_len and sliding_window is None:
            o = _sdpa(q, keys, values, None, scale, sinks, causal=True, softcap=softcap)
        else:
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[None]
            mask = _key_mask(query_pos, seq_lens[b : b + 1], seq_len, sliding_window)[:, None]
            # Keys no row sees (before the first row's window: the null block where a sliding window's
            # blocks were given back, never written): zeroed, or NaN there poisons the sum.
            hidden = ~mask.any(dim=2)[:, :, :, None]  # [1, 1, L, 1]
            keys, values = keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0)
            o = _sdpa(q, keys, values, mask, scale, sinks, softcap=softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out


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
    """Attention within each sequence of a variable-length batch, with no KV cache: the whole sequence is
    in the batch (pooling models run every prompt whole, in one step).

    Sequence b owns rows `query_start_loc[b]:query_start_loc[b+1]` of `query` `[T, H, D]` and of `key` /
    `value` `[T, Hkv, D]` (H a multiple of Hkv). `causal`: row i sees the keys at rows <= i of its sequence
    (within `sliding_window` of it, if given); else every key of its sequence (an encoder's bidirectional
    attention; a window is refused). Returns `[T, H, D]` (written into `out` if given). `sinks`,
    `softcap`: see the module docstring.
    """
    if sliding_window is not None and not causal:
        raise ValueError("a sliding window applies to causal attention only")
    out = torch.empty_like(query) if out is None else out
    starts = query_start_loc.tolist()
    for b in range(len(starts) - 1):  # sequences are few and large: a loop over them costs little
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        # 4-D [1, heads, len, D] inputs: torch's CPU flash kernel takes them (3-D falls back to math).
        q = query[None, start:end].transpose(1, 2)
        k = key[None, start:end].transpose(1, 2)
        v = value[None, start:end].transpose(1, 2)
        if sliding_window is None or end - start <= sliding_window:
            o = _sdpa(q, k, v, None, scale, sinks, causal=causal, softcap=softcap)
        else:
            pos = torch.arange(end - start, device=query.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
            o = _sdpa(q, k, v, mask, scale, sinks, softcap=softcap)
        out[start:end] = o[0].transpose(0, 1)
    return out

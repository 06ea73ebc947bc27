"""Attention on the CPU (kernels/cpu/paged_attention.c, varlen_attention.c), float32 queries: decode over the
paged KV cache, whole sequences without a cache, and prefill chunks over the paged cache.

Attention sinks (gpt-oss: `sinks` [H], a logit per query head that joins each softmax's denominator) go to
the C kernels as one more pointer (NULL without), attention logit soft-capping (Gemma 2: `softcap`, 0 = off)
as one more float; a decode over a float16 cache with either runs the torch reference."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import cast

import torch

from pagoda.kernels.cpu.arguments import as_int64, rows_contiguous, scratch_buffer
from pagoda.kernels.cpu.loader import load


def decode_attention_threads(batch: int, longest: int) -> int:
    """Threads for decode attention over `batch` sequences of at most `longest` keys: torch's count (fewer
    sequences than threads: each is split between them), or one where there is too little work to pay for
    waking a thread (from 256 keys on, two win)."""
    return 1 if batch * longest < 256 else torch.get_num_threads()


def _decode_attention_function(
    lib: dict[str, Callable[..., None]] | None,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    options: bool = False,
) -> Callable[..., None] | None:
    """The C paged decode attention for this query and cache (K and V alike), taking attention sinks and
    soft-capping if `options`, or None (the torch reference's case)."""
    if lib is None or query.dtype != torch.float32 or value_cache.dtype != key_cache.dtype:
        return None
    if options:
        return lib["paged_decode_attention_options_f32"] if key_cache.dtype == torch.float32 else None
    if key_cache.dtype == torch.float32:
        return lib["paged_decode_attention_f32"]
    if key_cache.dtype == torch.float16 and query.shape[-1] % 8 == 0:  # (the C code's condition)
        return lib.get("paged_decode_attention_f16kv")
    return None


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
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.attention.paged_decode_attention` (float32 queries, CPU; a
    float32 or float16 cache)."""
    lib = load()
    options = sinks is not None or bool(softcap)
    function = _decode_attention_function(lib, query, key_cache, value_cache, options)
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    if function is None or not contiguous or not _sinks_usable(sinks):
        from pagoda.kernels.torch_ref.attention import paged_decode_attention as reference

        return reference(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale,
            sliding_window,
            max_seq_len,
            sinks=sinks,
            softcap=softcap,
        )
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if not query.is_contiguous():
        query = query.contiguous()
    block_tables = as_int64(block_tables)
    seq_lens = as_int64(seq_lens)
    max_len = block_tables.shape[1] * block_size
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    threads = decode_attention_threads(batch, longest)
    out = torch.empty_like(query)
    assert lib is not None
    workspace_size = cast(Callable[..., int], lib["paged_decode_attention_workspace"])  # (restype int64)
    workspace = scratch_buffer(workspace_size(num_heads, max_len, threads))
    extra = (_sinks_pointer(sinks), softcap) if options else ()
    function(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        max_len,
        sliding_window or 0,
        scale,
        threads,
        *extra,
    )
    return out


def _sinks_pointer(sinks: torch.Tensor | None) -> int | None:
    """The C kernels' `sinks` argument: float32 [H] contiguous (the model's parameter already is), or NULL."""
    if sinks is None:
        return None
    assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.device.type == "cpu"
    return sinks.data_ptr()


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.attention.varlen_attention` (float32, CPU)."""
    lib = load()
    if lib is None or not all(rows_contiguous(x) for x in (query, key, value)) or not _sinks_usable(sinks):
        from pagoda.kernels.torch_ref.attention import varlen_attention as reference

        return reference(
            query, key, value, query_start_loc, scale, causal, sliding_window, sinks=sinks, softcap=softcap
        )
    if sliding_window is not None and not causal:
        raise ValueError("a sliding window applies to causal attention only")
    tokens, num_heads, head_dim = query.shape
    cu_seqlens = as_int64(query_start_loc)
    starts = cu_seqlens.tolist()  # (host arithmetic: tensor ops on a few numbers cost more than the lists)
    lens = [end - start for start, end in itertools.pairwise(starts)]
    num_seqs = len(lens)
    max_len = max(lens, default=0)
    out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    if max_len == 0:
        return out
    threads, workspace = _prefill_threads_and_workspace(lib, lens, lens, num_heads, key.shape[1], head_dim)
    failed = lib["varlen_attention_f32"](
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        cu_seqlens.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        num_seqs,
        num_heads,
        key.shape[1],
        head_dim,
        query.stride(0),
        key.stride(0),
        value.stride(0),
        max_len,
        int(causal),
        sliding_window or 0,
        scale,
        threads,
        _sinks_pointer(sinks),
        softcap,
    )
    if failed:
        raise MemoryError("varlen attention: no memory for its job table")
    return out


def _sinks_usable(sinks: torch.Tensor | None) -> bool:
    """Whether the C kernels take these sinks as they are (else the torch reference runs)."""
    return sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous())


def _prefill_threads_and_workspace(
    lib: dict[str, Callable[..., None]],
    query_lens: list[int],
    key_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[int, torch.Tensor]:
    """Threads and workspace for varlen_attention.c's jobs (64 query rows of one KV head each): torch's
    thread count, or one where there is too little work to pay for waking a thread."""
    threads = torch.get_num_threads()
    if sum(q * k for q, k in zip(query_lens, key_lens, strict=True)) * num_heads * head_dim < 1 << 18:
        threads = 1
    threads = min(threads, sum(-(-q // 64) for q in query_lens) * num_kv_heads)
    workspace_size = cast(Callable[..., int], lib["varlen_attention_workspace"])  # (restype int64)
    return threads, scratch_buffer(workspace_size(head_dim, max(key_lens, default=0), threads))


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
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as `pagoda.kernels.torch_ref.attention.paged_prefill_attention` (float32 queries and caches,
    CPU; other caches go to the reference)."""
    lib = load()
    caches_ok = all(c.dtype == torch.float32 and c.is_contiguous() for c in (key_cache, value_cache))
    if lib is None or not caches_ok or not rows_contiguous(query) or not _sinks_usable(sinks):
        from pagoda.kernels.torch_ref.attention import paged_prefill_attention as reference

        return reference(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
            sinks=sinks,
            softcap=softcap,
        )
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    cu_seqlens, seq_lens, block_tables = as_int64(query_start_loc), as_int64(seq_lens), as_int64(block_tables)
    starts, lens = cu_seqlens.tolist(), seq_lens.tolist()  # (host arithmetic, as in varlen_attention)
    chunks = [end - start for start, end in itertools.pairwise(starts)]
    if any(chunk > length for chunk, length in zip(chunks, lens, strict=True)):
        raise ValueError("paged prefill attention: a sequence has more query rows than keys")
    out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
    max_len = max(lens, default=0)
    if tokens == 0:
        return out
    threads, workspace = _prefill_threads_and_workspace(lib, chunks, lens, num_heads, num_kv_heads, head_dim)
    failed = lib["paged_prefill_attention_f32"](
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        cu_seqlens.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        len(lens),
        num_heads,
        num_kv_heads,
        head_dim,
        query.stride(0),
        block_size,
        block_tables.shape[1],
        max_len,
        sliding_window or 0,
        scale,
        threads,
        _sinks_pointer(sinks),
        softcap,
    )
    if failed:
        raise MemoryError("paged prefill attention: no memory for its job table")
    return out

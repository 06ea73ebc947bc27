"""The Triton attention kernels against the torch reference, run on the CPU by Triton's interpreter.

Poisoned throughout: never-written cache slots (the tail of each last block, the null block 0 that pads
block tables, spare blocks) and the `out` buffers hold NaN, so a kernel that reads past a sequence's end
or leaves an output element unwritten fails the NaN checks. Query inputs are strided views of a fused
QKV-like tensor, as the model passes them.

bf16 is tested only for `reshape_and_cache`: the interpreter computes `tl.dot` on bf16 operands wrongly
(it multiplies their raw 16-bit patterns), so bf16 attention can only be checked on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagoda.kernels.torch_ref import attention as ref
from pagoda.kernels.triton import attention as tri
from tests.kernels.devices import make_generator

pytestmark = pytest.mark.usefixtures("on_device")

NAN = float("nan")
# (head_dim, block_size, num_kv_heads, group = query heads per kv head, dtype)
CASES = [
    (64, 16, 2, 1, torch.float32),
    (64, 32, 1, 4, torch.float16),
    (128, 16, 1, 8, torch.float32),
    (128, 32, 2, 4, torch.float16),
    (64, 16, 2, 8, torch.float16),
    (96, 16, 2, 3, torch.float16),  # head_dim and group not powers of two: padded, masked lanes and rows
]
CASE_IDS = [f"d{d}-bs{bs}-kv{kv}-g{g}-{str(dt)[6:]}" for d, bs, kv, g, dt in CASES]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "NaN in the output: an unwritten element or a poisoned slot was read"
    tol = dict(atol=1e-5, rtol=1e-4) if actual.dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def make_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_columns: int = 1,
):
    """NaN-filled caches holding random K/V for each sequence in random, non-contiguous blocks (never
    block 0, the null block that pads block tables, which have `spare_columns` extra columns)."""
    num_blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(num_blocks) + 3
    key_cache = torch.full((total, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)
    value_cache = torch.full_like(key_cache, NAN)
    free = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(num_blocks) + spare_columns, dtype=torch.long)
    for b, (n, nb) in enumerate(zip(seq_lens, num_blocks, strict=True)):
        block_tables[b, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.long)
        pos = torch.arange(n)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ref.reshape_and_cache(k, v, key_cache, value_cache, slots)
    return key_cache, value_cache, block_tables


def strided_query(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """`[T, H, D]` view of the Q part of a fused `[T, H + 2 * Hkv, D]` tensor (token stride != H * D)."""
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    return fused[:, :num_heads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim,num_kv_heads", [(64, 2), (128, 1)])
def test_reshape_and_cache(dtype, head_dim, num_kv_heads):
    gen = make_generator(head_dim)
    block_size, num_blocks = 16, 6
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)
    value_cache = torch.full_like(key_cache, NAN)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[[3, 11, 12]] = -1  # padding tokens: must not be written anywhere
    fused = torch.randn(20, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]  # strided views
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ref.reshape_and_cache(key, value, expected_k, expected_v, slots)
    tri.reshape_and_cache(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    written = ~key_cache.view(-1, num_kv_heads, head_dim).isnan().all(-1).all(-1)
    assert written.sum() == 17 and written[slots[slots >= 0]].all()  # the rest is untouched NaN


@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("max_seq_len", [None, 100, 1], ids=["hint-none", "hint-2-splits", "hint-1-split"])
def test_paged_decode_attention(head_dim, block_size, num_kv_heads, group, dtype, max_seq_len):
    """Ragged lengths (1, block multiples, partial last blocks, several 64-token tiles), one seq_len-0
    padding row. `max_seq_len` only sizes the split count, so any hint must give the same result: None
    (3 splits here: sequences shorter than the longest get empty splits), 100 (2 splits of 2 and 1 tiles)
    and 1 (no split)."""
    gen = make_generator(head_dim + block_size + group)
    seq_lens = [1, block_size, 0, 2 * block_size + 5, 3 * block_size, 150]
    key_cache, value_cache, block_tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = strided_query(len(seq_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    lens, scale = torch.tensor(seq_lens), head_dim**-0.5
    out = torch.full(query.shape, NAN, dtype=dtype)
    result = tri.paged_decode_attention(
        query, key_cache, value_cache, block_tables, lens, scale, max_seq_len=max_seq_len, out=out
    )
    assert result is out
    expected = ref.paged_decode_attention(
        query.float(), key_cache.float(), value_cache.float(), block_tables, lens, scale
    )
    real = lens > 0
    assert_matches(out[real], expected[real])
    assert out[~real].eq(0).all()  # the padding row: zeros, no NaN


@pytest.mark.parametrize("sliding_window", [20, 64])
def test_paged_decode_attention_sliding_window(sliding_window):
    gen = make_generator(sliding_window)
    head_dim, block_size, num_kv_heads, group, dtype = 64, 16, 2, 4, torch.float32
    seq_lens = [1, 19, 20, 21, 64, 150]
    key_cache, value_cache, block_tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = strided_query(len(seq_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    lens, scale = torch.tensor(seq_lens), head_dim**-0.5
    out = tri.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        lens,
        scale,
        sliding_window,
        out=torch.full(query.shape, NAN, dtype=dtype),
    )
    expected = ref.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, scale, sliding_window)
    assert_matches(out, expected)


def run_prefill(seq_lens, query_lens, head_dim, block_size, num_kv_heads, group, dtype, sliding_window, gen):
    key_cache, value_cache, block_tables = make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = strided_query(sum(query_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0)
    lens, scale = torch.tensor(seq_lens), head_dim**-0.5
    out = torch.full(query.shape, NAN, dtype=dtype)
    result = tri.paged_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, lens, scale, sliding_window, out=out
    )
    assert result is out
    expected = ref.paged_prefill_attention(
        query.float(),
        key_cache.float(),
        value_cache.float(),
        block_tables,
        query_start_loc,
        lens,
        scale,
        sliding_window,
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group,dtype", CASES, ids=CASE_IDS)
def test_paged_prefill_attention(head_dim, block_size, num_kv_heads, group, dtype):
    """One call mixing whole prompts (no prefix; one a block multiple) and chunks over a cached prefix
    (a single token, a partial block, a block's worth, and one spanning several query and key tiles)."""
    gen = make_generator(head_dim + block_size + group + 1)
    seq_lens = [5, 2 * block_size, 2 * block_size, 45, 3 * block_size + 3, 130]
    query_lens = [5, 2 * block_size, 1, 13, block_size, 70]
    run_prefill(seq_lens, query_lens, head_dim, block_size, num_kv_heads, group, dtype, None, gen)


def test_paged_prefill_attention_sliding_window():
    gen = make_generator(3)
    seq_lens, query_lens = [30, 100, 130], [30, 1, 90]
    run_prefill(seq_lens, query_lens, 64, 16, 2, 4, torch.float16, 20, gen)


def test_empty_inputs_are_no_ops():
    key_cache = torch.full((2, 16, 1, 64), NAN)
    tri.reshape_and_cache(
        torch.empty(0, 1, 64), torch.empty(0, 1, 64), key_cache, key_cache.clone(), torch.empty(0, dtype=torch.long)
    )
    assert key_cache.isnan().all()
    out = tri.paged_decode_attention(
        torch.empty(0, 2, 64),
        key_cache,
        key_cache,
        torch.zeros(0, 1, dtype=torch.long),
        torch.empty(0, dtype=torch.long),
        0.125,
    )
    assert out.shape == (0, 2, 64)

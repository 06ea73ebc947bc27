"""The compiled CPU paged prefill attention (a prompt's later chunk, or its rest after a prefix-cache hit)
against naive float64 attention over the same keys.

K/V are scattered into random, non-contiguous cache blocks whose never-written slots hold NaN
(tests/kernels/paged_inputs.py), so a kernel that reads past a sequence's keys fails the NaN check.
Chunks cover no prefix, one query row, rows past one 8-row tile and one 64-row job, prefixes that end
inside a block, and several sequences in one call.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu, ops
from tests.kernels.paged_inputs import SHAPES, naive_attention, scatter_to_cache

# (keys of the sequence, query rows: its last ones)
SEQUENCES = [(5, 5), (32, 1), (45, 13), (99, 19), (150, 70), (300, 133)]


def run(head_dim, block_size, groups, window, sequences, seed=0, cache_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed + head_dim + block_size + groups)
    seq_lens = [n for n, _ in sequences]
    query_lens = [q for _, q in sequences]
    num_kv_heads = 2
    kc, vc, bt, keys, values = scatter_to_cache(seq_lens, block_size, num_kv_heads, head_dim, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * groups, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    scale = head_dim**-0.5
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    out = cpu.paged_prefill_attention(q, kc, vc, bt, starts, torch.tensor(seq_lens), scale, window)
    assert not out.isnan().any()
    for b, (n, rows) in enumerate(sequences):
        k, v = keys[b].to(cache_dtype), values[b].to(cache_dtype)
        expected = naive_attention(q[starts[b] : starts[b + 1]], k, v, n - rows, scale, window)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim,block_size,groups", SHAPES)
@pytest.mark.parametrize("window", [None, 20])
def test_compiled_kernel_matches_naive_over_a_paged_prefix(head_dim, block_size, groups, window):
    assert cpu.available() and ops.compiled("paged_prefill_attention", torch.device("cpu"))
    run(head_dim, block_size, groups, window, SEQUENCES)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_long_chunk_after_a_long_prefix(threads):
    """A 1,000-token context whose last 300 tokens are the chunk: five jobs per KV head, shared out over
    the threads; a window of 100 reaches back over a job's start and past the chunk's first row."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 100):
            run(64, 16, 3, window, [(1000, 300)], seed=threads)
    finally:
        torch.set_num_threads(before)


def test_a_float16_cache_takes_the_reference_and_is_right():
    run(64, 16, 2, None, SEQUENCES[:3], cache_dtype=torch.float16)


def test_more_query_rows_than_keys_is_refused():
    kc = torch.zeros(4, 16, 1, 64)
    with pytest.raises(ValueError, match="more query rows than keys"):
        cpu.paged_prefill_attention(
            torch.zeros(5, 1, 64), kc, kc, torch.tensor([[1]]), torch.tensor([0, 5]), torch.tensor([4]), 0.125, None
        )


@pytest.mark.parametrize("implementation", ["torch_ref", "cpu"])
def test_given_back_blocks_before_the_window_are_never_read(implementation):
    """A sliding window's blocks that left it point at the null block (engine_core/kv_cache.py), which holds
    whatever the pool's memory held: NaN there must not reach the output (the torch reference gathers the
    whole context and masks it; it zeroes what no row sees)."""
    from pagoda.kernels.torch_ref import attention as torch_ref

    torch.manual_seed(0)
    heads, head_dim, block = 2, 64, 4
    key_cache, value_cache = torch.randn(4, block, heads, head_dim), torch.randn(4, block, heads, head_dim)
    query = torch.randn(2, heads, head_dim)  # positions 10 and 11 of 12, window 4: keys 7..11 only
    args = (torch.tensor([0, 2]), torch.tensor([12]), head_dim**-0.5, 4)
    clean = torch_ref.paged_prefill_attention(query, key_cache, value_cache, torch.tensor([[1, 2, 3]]), *args)
    key_cache[0], value_cache[0] = float("nan"), float("nan")  # (block 0 stands in for the given-back block 1)
    kernel = torch_ref.paged_prefill_attention if implementation == "torch_ref" else cpu.paged_prefill_attention
    out = kernel(query, key_cache, value_cache, torch.tensor([[0, 2, 3]]), *args)
    torch.testing.assert_close(out, clean)

"""The compiled CPU kernels against the torch reference: attention, the norms and SiLU-and-mul to
float tolerance (sums and exp in another order), rotary and the cache write bit for bit (built without
fast-math: they are the same IEEE operations)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu
from pagoda.kernels.cpu import attention as cpu_attention
from pagoda.kernels.torch_ref import attention as ref_attention
from pagoda.kernels.torch_ref import layers as ref_layers
from tests.kernels.paged_inputs import SHAPES, scatter_to_cache


def test_cpu_kernels_build():
    assert cpu.available(), "the C kernels must build on this machine (a C compiler is part of the setup)"


def test_loading_the_kernels_leaves_the_process_floating_point_state_alone():
    import subprocess
    import sys

    # In a fresh process: once loaded, flush-to-zero would make the smallest normal double / 4 zero.
    code = "from pagoda.kernels import cpu; assert cpu.available(); print(2.2250738585072014e-308 / 4 != 0.0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True", result.stderr


# (+ head sizes that are not a multiple of 64 or of 32, and groups that are not a multiple of the three
# heads the V pass takes at a time: SmolLM2's 3, and 5 = 3 + 2)
# (+ rows that do not start on a cache line, nor end on one: a float16 row of 2 heads x 40 is 160 bytes)
@pytest.mark.parametrize("head_dim,block_size,groups", SHAPES + [(96, 16, 2), (40, 16, 3), (64, 16, 3), (96, 16, 5)])
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_compiled_cpu_decode_attention_matches_reference(head_dim, block_size, groups, sliding_window, cache_dtype):
    reference = ref_attention.paged_decode_attention
    gen = torch.Generator().manual_seed(3 + head_dim + groups)
    seq_lens = [1, block_size, 2 * block_size, 37, 3 * block_size + 1] * 3  # enough work for threads
    kc, vc, bt, _, _ = scatter_to_cache(seq_lens, block_size, 2, head_dim, gen)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    q = torch.randn(len(seq_lens), 2 * groups, head_dim, generator=gen)
    lens = torch.tensor(seq_lens)
    ours = cpu.paged_decode_attention(q, kc, vc, bt, lens, head_dim**-0.5, sliding_window)
    ref = reference(q, kc, vc, bt, lens, head_dim**-0.5, sliding_window)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    one = cpu.paged_decode_attention(q[3:4], kc, vc, bt[3:4], lens[3:4], head_dim**-0.5, sliding_window)
    torch.testing.assert_close(one, ref[3:4], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_fewer_sequences_than_threads_split_each_sequence_and_merge_exactly(threads, sliding_window, cache_dtype):
    """One stream (batch 1) or a few: each sequence's tokens are divided between the threads and the
    parts' softmaxes merged. Lengths from one part holding every token to parts of a few blocks."""
    reference = ref_attention.paged_decode_attention
    gen = torch.Generator().manual_seed(threads)
    seq_lens = [2500, 9, 700][: threads - 1] if threads > 2 else [2100]
    kc, vc, bt, _, _ = scatter_to_cache(seq_lens, 16, 3, 64, gen)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    q = torch.randn(len(seq_lens), 9, 64, generator=gen)
    lens = torch.tensor(seq_lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = cpu.paged_decode_attention(q, kc, vc, bt, lens, 0.125, sliding_window)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(ours, reference(q, kc, vc, bt, lens, 0.125, sliding_window), atol=2e-5, rtol=1e-4)


def _fused_qkv(tokens, num_heads, num_kv_heads, head_dim, gen):
    """q, k, v as views of one fused projection output, the way the model produces them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.reshape(tokens, num_heads, head_dim),
        k.reshape(tokens, num_kv_heads, head_dim),
        v.reshape(tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_is_bit_identical_to_reference(neox, head_dim, rot_dim):
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    from pagoda.engine_core.layers.rotary import RotaryEmbedding

    cos_sin = RotaryEmbedding(rot_dim, 512, 10000.0).cos_sin_cache
    q, k, _ = _fused_qkv(7, 6, 2, head_dim, gen)
    positions = torch.tensor([0, 1, 15, 16, 200, 511, 3])
    expected_q, expected_k = ref_layers.rotary_embedding(positions, q.clone(), k.clone(), cos_sin, neox)
    out_q, out_k = cpu.rotary_embedding(positions, q, k, cos_sin, neox)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert out_q.data_ptr() == q.data_ptr()  # in place, as the Triton contract says


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_reshape_and_cache_matches_reference_and_skips_negative_slots(cache_dtype):
    """A float16 cache gets each value rounded to nearest-even, as torch's conversion does (values past
    float16's range become infinities in both)."""
    gen = torch.Generator().manual_seed(0)
    _, k, v = _fused_qkv(5, 4, 2, 64, gen)
    k[0, 0, :3] = torch.tensor([1e5, -7e4, 1.0 + 2**-11])  # overflow, and a tie between two float16s
    slots = torch.tensor([3, -1, 17, 0, 40])
    caches = [torch.full((4, 16, 2, 64), float("nan"), dtype=cache_dtype) for _ in range(4)]
    ref_attention.reshape_and_cache(k, v, caches[0], caches[1], slots)
    cpu.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert caches[2].view(-1, 2, 64)[[3, 17, 0, 40]].isnan().sum() == 0


def test_the_float16_cache_kernels_exist_where_the_cpu_converts_halves():
    """Without them a float16 cache still works, through the torch reference: so check that this
    machine (F16C, every AVX2 CPU has it) builds the C ones and that the wrappers take them."""
    has_f16c = " f16c" in open("/proc/cpuinfo").read()  # noqa: SIM115
    if not has_f16c:
        pytest.skip("this CPU has no F16C")
    lib = cpu.load()
    assert lib is not None and "paged_decode_attention_f16kv" in lib and "reshape_and_cache_f16kv" in lib
    function_for = cpu_attention._decode_attention_function
    query, cache = torch.zeros(1, 2, 64), torch.zeros(2, 16, 1, 64, dtype=torch.float16)
    assert function_for(lib, query, cache, cache) is lib["paged_decode_attention_f16kv"]
    assert function_for(lib, query, cache, cache.float()) is None  # (K and V differ)
    narrow = cache[..., :12]
    assert function_for(lib, torch.zeros(1, 2, 12), narrow, narrow) is None  # (head size % 8)


# Widths: SmolLM2's hidden size and half its MLP, a head, and odd ones (the vector loops' scalar tails).
# Rows: one (a single thread), and enough to be shared out between threads.
_WIDTHS = [576, 1536, 64, 13, 1]
_ROWS = [1, 300]


def _on_threads(threads: int, run):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rows", _ROWS)
@pytest.mark.parametrize("width", _WIDTHS)
def test_rms_norm_and_its_residual_add_match_reference(width, rows, threads):
    gen = torch.Generator().manual_seed(width + rows)
    x, residual = torch.randn(2, rows, width, generator=gen) * 3
    weight = torch.rand(width, generator=gen) + 0.5
    normed = _on_threads(threads, lambda: cpu.rms_norm(x, weight, 1e-5))
    torch.testing.assert_close(normed, ref_layers.rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)
    out, total = _on_threads(threads, lambda: cpu.fused_add_rms_norm(x, residual, weight, 1e-5))
    expected_out, expected_total = ref_layers.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, expected_total)  # (one float add per element: the same bits)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    assert out.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # new tensors, as the reference returns
    # eps counts: a row of zeros would otherwise divide by zero
    zeros = cpu.rms_norm(torch.zeros(rows, width), weight, 0.25)
    assert torch.equal(zeros, torch.zeros(rows, width))
    small = torch.full((1, width), 0.5)
    torch.testing.assert_close(cpu.rms_norm(small, weight, 0.75), weight[None] * 0.5, rtol=1e-6, atol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_per_head_rms_norm_reads_heads_of_a_fused_qkv_view(threads):
    """Qwen3's q/k norms: [T, heads, D] views of the fused QKV output, a token's heads adjacent and tokens
    a whole QKV row apart."""
    gen = torch.Generator().manual_seed(9)
    q, k, _ = _fused_qkv(400, 6, 2, 64, gen)
    weight = torch.rand(64, generator=gen) + 0.5
    for heads in (q, k):
        normed = _on_threads(threads, lambda heads=heads: cpu.rms_norm(heads, weight, 1e-6))
        assert normed.shape == heads.shape and normed.is_contiguous()
        torch.testing.assert_close(normed, ref_layers.rms_norm(heads, weight, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rows", _ROWS)
@pytest.mark.parametrize("width", _WIDTHS)
def test_silu_and_mul_matches_reference_to_saturation(width, rows, threads):
    gen = torch.Generator().manual_seed(width * rows)
    x = torch.randn(rows, 2 * width, generator=gen) * 4
    x[0, :width] = torch.linspace(-300.0, 300.0, width)  # gates where exp(-gate) underflows or overflows
    out = _on_threads(threads, lambda: cpu.silu_and_mul(x))
    expected = ref_layers.silu_and_mul(x)
    assert out.shape == (rows, width)
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    assert out.isfinite().all()


def test_norms_and_activation_take_the_reference_for_what_they_do_not_cover():
    """Other dtypes and layouts get the torch reference's result, not a misread buffer."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=gen)
    weight = torch.rand(64, generator=gen)
    as_bf16 = cpu.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, ref_layers.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5))
    wide = torch.randn(8, 128, generator=gen)
    transposed = wide.t().contiguous().t()  # (column-major rows)
    torch.testing.assert_close(cpu.silu_and_mul(transposed), ref_layers.silu_and_mul(wide), rtol=2e-6, atol=1e-6)
    three_d = torch.randn(2, 4, 64, generator=gen)
    torch.testing.assert_close(
        cpu.fused_add_rms_norm(three_d, three_d, weight, 1e-5)[0],
        ref_layers.fused_add_rms_norm(three_d, three_d, weight, 1e-5)[0],
    )


def test_decode_attention_reads_no_byte_past_a_float16_cache_that_ends_at_an_unmapped_page():
    """One KV head of 40 float16s is an 80-byte row: a kernel that touched it in 32-byte loads from its
    start read 16 bytes past the last row. The cache here ends where an inaccessible page begins, so
    such a read faults (in a child process, so that a fault fails this test instead of ending pytest)."""
    import subprocess
    import sys

    code = """
import ctypes, mmap, torch
from pagoda.kernels import cpu
page = mmap.PAGESIZE
buffer = mmap.mmap(-1, 3 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
libc = ctypes.CDLL(None)
assert libc.mprotect(ctypes.c_void_p(base + 2 * page), page, 0) == 0  # PROT_NONE after two pages
block = 16 * 1 * 40 * 2  # bytes of one block: 16 tokens x 1 head x 40 float16s
blocks = 2 * page // block
cache = torch.frombuffer(buffer, dtype=torch.float16, count=blocks * block // 2, offset=2 * page - blocks * block)
cache = cache.view(blocks, 16, 1, 40)
cache.normal_()
table = torch.tensor([[blocks - 1]])  # the last block, up to its last row
q = torch.randn(1, 2, 40)
out = cpu.paged_decode_attention(q, cache, cache, table, torch.tensor([16]), 0.15)
ref = __import__("pagoda.kernels.torch_ref.attention", fromlist=["x"]).paged_decode_attention(
    q, cache, cache, table, torch.tensor([16]), 0.15)
torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]

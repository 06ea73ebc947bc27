"""The compiled CPU kernels against the torch reference: attention to float tolerance, the
element-wise ops bit for bit (they are built without fast-math so greedy tokens stay exact)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu
from kernels.torch_ref import attention as ref_attention
from kernels.torch_ref import layers as ref_layers
from tests.kernels.paged_inputs import SHAPES, scatter_to_cache


def test_cpu_kernels_build():
    assert cpu.available(), "the C kernels must build on this machine (a C compiler is part of the setup)"


def test_loading_the_kernels_leaves_the_process_floating_point_state_alone():
    import subprocess
    import sys

    # In a fresh process: once loaded, flush-to-zero would make the smallest normal double / 4 zero.
    code = "from kernels import cpu; assert cpu.available(); print(2.2250738585072014e-308 / 4 != 0.0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True", result.stderr


# (+ head sizes that are not a multiple of 64: the vector path's V pass does the last 8 to 56 dims apart)
@pytest.mark.parametrize("head_dim,block_size,groups", SHAPES + [(96, 16, 2), (40, 16, 3)])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_compiled_cpu_decode_attention_matches_reference(head_dim, block_size, groups, sliding_window):
    reference = ref_attention.paged_decode_attention
    gen = torch.Generator().manual_seed(3 + head_dim + groups)
    seq_lens = [1, block_size, 2 * block_size, 37, 3 * block_size + 1] * 3  # enough work for threads
    kc, vc, bt, _, _ = scatter_to_cache(seq_lens, block_size, 2, head_dim, gen)
    q = torch.randn(len(seq_lens), 2 * groups, head_dim, generator=gen)
    lens = torch.tensor(seq_lens)
    ours = cpu.paged_decode_attention(q, kc, vc, bt, lens, head_dim**-0.5, sliding_window)
    ref = reference(q, kc, vc, bt, lens, head_dim**-0.5, sliding_window)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    one = cpu.paged_decode_attention(q[3:4], kc, vc, bt[3:4], lens[3:4], head_dim**-0.5, sliding_window)
    torch.testing.assert_close(one, ref[3:4], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_fewer_sequences_than_threads_split_each_sequence_and_merge_exactly(threads, sliding_window):
    """One stream (batch 1) or a few: each sequence's tokens are divided between the threads and the
    parts' softmaxes merged. Lengths from one part holding every token to parts of a few blocks."""
    reference = ref_attention.paged_decode_attention
    gen = torch.Generator().manual_seed(threads)
    seq_lens = [2500, 9, 700][: threads - 1] if threads > 2 else [2100]
    kc, vc, bt, _, _ = scatter_to_cache(seq_lens, 16, 3, 64, gen)
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
    from engine_core.layers.rotary import RotaryEmbedding

    cos_sin = RotaryEmbedding(rot_dim, 512, 10000.0).cos_sin_cache
    q, k, _ = _fused_qkv(7, 6, 2, head_dim, gen)
    positions = torch.tensor([0, 1, 15, 16, 200, 511, 3])
    expected_q, expected_k = ref_layers.rotary_embedding(positions, q.clone(), k.clone(), cos_sin, neox)
    out_q, out_k = cpu.rotary_embedding(positions, q, k, cos_sin, neox)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert out_q.data_ptr() == q.data_ptr()  # in place, as the Triton contract says


def test_reshape_and_cache_matches_reference_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    _, k, v = _fused_qkv(5, 4, 2, 64, gen)
    slots = torch.tensor([3, -1, 17, 0, 40])
    caches = [torch.full((4, 16, 2, 64), float("nan")) for _ in range(4)]
    ref_attention.reshape_and_cache(k, v, caches[0], caches[1], slots)
    cpu.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert caches[2].view(-1, 2, 64)[[3, 17, 0, 40]].isnan().sum() == 0

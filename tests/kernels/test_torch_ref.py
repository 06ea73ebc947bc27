"""The torch reference kernels against naive per-sequence attention over contiguous K/V.

Random K/V are scattered into random, non-contiguous blocks; outputs are poisoned before each run."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import ops
from pagoda.kernels.torch_ref import attention as ref_attention
from pagoda.kernels.torch_ref import layers
from tests.kernels.paged_inputs import SHAPES, naive_attention, scatter_to_cache


@pytest.mark.parametrize("head_dim,block_size,groups", SHAPES)
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_paged_decode_attention(head_dim, block_size, groups, sliding_window):
    gen = torch.Generator().manual_seed(head_dim + block_size + groups)
    seq_lens = [1, block_size, 2 * block_size, 37, 3 * block_size + 1]
    num_kv_heads = 2
    kc, vc, bt, keys, values = scatter_to_cache(seq_lens, block_size, num_kv_heads, head_dim, gen)
    q = torch.randn(len(seq_lens), num_kv_heads * groups, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = ref_attention.paged_decode_attention(q, kc, vc, bt, torch.tensor(seq_lens), scale, sliding_window)
    for b, n in enumerate(seq_lens):
        ref = naive_attention(q[b : b + 1], keys[b], values[b], n - 1, scale, sliding_window)[0]
        torch.testing.assert_close(out[b].double(), ref, atol=2e-5, rtol=1e-4)
    assert not out.isnan().any()


@pytest.mark.parametrize("head_dim,block_size,groups", SHAPES)
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_paged_prefill_attention_over_prefix(head_dim, block_size, groups, sliding_window):
    gen = torch.Generator().manual_seed(7 + head_dim + groups)
    seq_lens = [5, 2 * block_size, 45, 3 * block_size + 3]
    query_lens = [5, 1, 13, block_size]  # the first has no prefix; the others extend a cached prefix
    num_kv_heads = 2
    kc, vc, bt, keys, values = scatter_to_cache(seq_lens, block_size, num_kv_heads, head_dim, gen)
    q = torch.randn(sum(query_lens), num_kv_heads * groups, head_dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist())
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    out[:] = ref_attention.paged_prefill_attention(q, kc, vc, bt, qsl, torch.tensor(seq_lens), scale, sliding_window)
    for b, (n, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        ref = naive_attention(q[qsl[b] : qsl[b + 1]], keys[b], values[b], n - ql, scale, sliding_window)
        torch.testing.assert_close(out[qsl[b] : qsl[b + 1]].double(), ref, atol=2e-5, rtol=1e-4)
    assert not out.isnan().any()


def test_reshape_and_cache_skips_negative_slots():
    kc = torch.zeros(3, 4, 1, 2)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 1, 2)
    ops.reshape_and_cache(k, 2 * k, kc, vc, torch.tensor([5, -1, 8]))
    assert kc.view(-1, 1, 2)[[5, 8]].eq(1).all() and kc.sum() == 4 and vc.sum() == 8


def test_rotary_neox_matches_hf_rotate_half_and_gptj_pairs():
    from pagoda.engine_core.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(8, 32, 10000.0)
    pos = torch.tensor([0, 3, 31])
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q_out, k_out = layers.rotary_embedding(pos, q, k, rope.cos_sin_cache, True)
    cos, sin = rope.cos_sin_cache[pos].chunk(2, -1)
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    rotate_half = lambda x: torch.cat((-x[..., 4:], x[..., :4]), -1)  # noqa: E731
    torch.testing.assert_close(q_out, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(k_out, k * cos + rotate_half(k) * sin)
    q_gptj, _ = layers.rotary_embedding(pos, q, k, rope.cos_sin_cache, False)
    c, s = rope.cos_sin_cache[pos].chunk(2, -1)
    expected_even = q[..., 0::2] * c[:, None] - q[..., 1::2] * s[:, None]
    torch.testing.assert_close(q_gptj[..., 0::2], expected_even)


def test_norms_and_activation():
    x, res, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    ref = w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(layers.rms_norm(x, w, 1e-6), ref)
    normed, new_res = layers.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, layers.rms_norm(x + res, w, 1e-6))
    gate_up = torch.randn(4, 32)
    torch.testing.assert_close(
        layers.silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:]
    )

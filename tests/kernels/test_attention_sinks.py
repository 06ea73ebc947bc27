"""Attention sinks (gpt-oss: a logit per query head that joins each softmax's denominator and attends to
nothing) in the three attention ops: the torch reference and the compiled CPU kernels, the latter built for
every instruction set this machine runs (tests/kernels/isa_variants.py), against naive float64 attention.

Sinks are drawn both small and large (a sink above every score: the C decode kernel's other branch), with
and without a sliding window, over grouped heads; decodes both one sequence (split into parts over the
threads) and several (whole sequences), with a head_dim that takes the vector path and one that does not.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels.torch_ref import attention as ref
from tests.kernels import isa_variants
from tests.kernels.paged_inputs import run_attention, scatter_to_cache

# (head_dim, num_kv_heads, query heads per kv head)
SHAPES = [(32, 2, 2), (20, 1, 4)]  # (20: no vector path in the decode kernel)
WINDOWS = [None, 5]
SINK_SCALES = [1.0, 30.0]  # (30: sinks above every score)


def naive(q, k, v, q_start_pos, scale, sinks, window=None, causal=True):
    """q [Q, H, D] at positions q_start_pos.., k/v [L, Hkv, D] -> [Q, H, D] in float64, the sink a column
    of the softmax whose value row is zero."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + q_start_pos
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos if causal else torch.ones_like(kpos <= qpos)
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def _sinks(heads, scale_, seed):
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * scale_


@pytest.fixture(scope="module")
def paged_libraries(tmp_path_factory):
    return isa_variants.build_all("paged_attention", tmp_path_factory)


@pytest.fixture(scope="module")
def varlen_libraries(tmp_path_factory):
    return isa_variants.build_all("varlen_attention", tmp_path_factory)


VARIANTS = ["reference", "native", *(name for name, _ in isa_variants.variants())]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sink_scale", SINK_SCALES)
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_with_sinks(
    monkeypatch, paged_libraries, variant, head_dim, num_kv_heads, group, window, sink_scale, batch
):
    gen = torch.Generator().manual_seed(head_dim + batch)
    seq_lens = [37, 9, 70][:batch]
    key_cache, value_cache, block_tables, keys, values = scatter_to_cache(seq_lens, 16, num_kv_heads, head_dim, gen)
    heads = num_kv_heads * group
    query = torch.randn(batch, heads, head_dim, generator=gen)
    sinks, scale = _sinks(heads, sink_scale, batch), head_dim**-0.5
    which = {"reference": None}.get(variant, variant)
    out = run_attention(
        monkeypatch,
        paged_libraries,
        which,
        "paged_decode_attention",
        query,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(seq_lens),
        scale,
        window,
        sinks=sinks,
    )
    for b, n in enumerate(seq_lens):
        want = naive(query[b : b + 1], keys[b], values[b], n - 1, scale, sinks, window)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sink_scale", SINK_SCALES)
def test_varlen_with_sinks(monkeypatch, varlen_libraries, variant, head_dim, num_kv_heads, group, window, sink_scale):
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 17, 70]
    heads = num_kv_heads * group
    q = torch.randn(sum(lens), heads, head_dim, generator=gen)
    k = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    sinks, scale = _sinks(heads, sink_scale, 7), head_dim**-0.5
    which = {"reference": None}.get(variant, variant)
    out = run_attention(
        monkeypatch, varlen_libraries, which, "varlen_attention", q, k, v, starts, scale, True, window, sinks=sinks
    )
    for b, n in enumerate(lens):
        s = int(starts[b])
        want = naive(q[s : s + n], k[s : s + n], v[s : s + n], 0, scale, sinks, window)
        torch.testing.assert_close(out[s : s + n].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sink_scale", SINK_SCALES)
def test_paged_prefill_with_sinks(
    monkeypatch, varlen_libraries, variant, head_dim, num_kv_heads, group, window, sink_scale
):
    """Chunks of each sequence's last tokens over a cached prefix (the chunked-prefill and prefix-cache
    path), one chunk the whole sequence."""
    gen = torch.Generator().manual_seed(head_dim + 1)
    seq_lens, chunks = [40, 23, 9], [12, 23, 1]
    key_cache, value_cache, block_tables, keys, values = scatter_to_cache(seq_lens, 16, num_kv_heads, head_dim, gen)
    heads = num_kv_heads * group
    query = torch.randn(sum(chunks), heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    sinks, scale = _sinks(heads, sink_scale, 3), head_dim**-0.5
    which = {"reference": None}.get(variant, variant)
    out = run_attention(
        monkeypatch,
        varlen_libraries,
        which,
        "paged_prefill_attention",
        query,
        key_cache,
        value_cache,
        block_tables,
        starts,
        torch.tensor(seq_lens),
        scale,
        window,
        sinks=sinks,
    )
    for b, (n, c) in enumerate(zip(seq_lens, chunks, strict=True)):
        s = int(starts[b])
        want = naive(query[s : s + c], keys[b], values[b], n - c, scale, sinks, window)
        torch.testing.assert_close(out[s : s + c].double(), want, atol=2e-5, rtol=1e-4)


def test_sinks_only_shrink_the_weights():
    """A sink of -inf is no sink: the output equals plain attention's; a finite sink changes it."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 4, 32, generator=gen) for _ in range(3))
    starts = torch.tensor([0, 12])
    plain = ref.varlen_attention(q, k, v, starts, 0.2)
    none = ref.varlen_attention(q, k, v, starts, 0.2, sinks=torch.full((4,), -math.inf))
    torch.testing.assert_close(none, plain)
    damped = ref.varlen_attention(q, k, v, starts, 0.2, sinks=torch.full((4,), 3.0))
    assert not torch.allclose(damped, plain)


def test_the_triton_entries_run_the_reference_with_sinks():
    """Triton's kernels have no sink term: given sinks, each entry returns the torch reference's result
    (before any launch, so this runs on the CPU too)."""
    pytest.importorskip("triton")
    from pagoda.kernels.triton import attention as triton_attention
    from pagoda.kernels.triton import varlen_attention as triton_varlen

    gen = torch.Generator().manual_seed(4)
    key_cache, value_cache, block_tables, _, _ = scatter_to_cache([20, 9], 16, 2, 32, gen)
    query, sinks = torch.randn(2, 4, 32, generator=gen), _sinks(4, 1.0, 5)
    seq_lens, starts = torch.tensor([20, 9]), torch.tensor([0, 1, 2])
    args = (query, key_cache, value_cache, block_tables, seq_lens, 0.2, 5)
    torch.testing.assert_close(
        triton_attention.paged_decode_attention(*args, sinks=sinks), ref.paged_decode_attention(*args, sinks=sinks)
    )
    args = (query, key_cache, value_cache, block_tables, starts, seq_lens, 0.2, None)
    torch.testing.assert_close(
        triton_attention.paged_prefill_attention(*args, sinks=sinks), ref.paged_prefill_attention(*args, sinks=sinks)
    )
    q, k, v = (torch.randn(12, 4, 32, generator=gen) for _ in range(3))
    args = (q, k, v, torch.tensor([0, 5, 12]), 0.2, True, 3)
    torch.testing.assert_close(
        triton_varlen.varlen_attention(*args, sinks=sinks), ref.varlen_attention(*args, sinks=sinks)
    )

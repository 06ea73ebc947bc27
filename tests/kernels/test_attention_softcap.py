"""Attention logit soft-capping (Gemma 2: each scaled score s becomes cap * tanh(s / cap) before the mask and
the softmax) in the three attention ops: the torch reference and the compiled CPU kernels, the latter built
for every instruction set this machine runs (tests/kernels/isa_variants.py), against naive float64
attention; and the Triton kernels (Triton's interpreter on the CPU) against the torch reference.

The scores are scaled up (scale 1, not head_dim ** -0.5) so that the cap changes them a lot; the cases run
with and without a sliding window, over grouped heads, with a head_dim that takes the C decode kernel's
vector path and one that does not, decodes of one sequence (split into parts over the threads) and of
several, and once together with attention sinks.
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
CAP = 5.0
SCALE = 1.0  # (scores of a few units: the cap bends them)
VARIANTS = ["reference", "native", *(name for name, _ in isa_variants.variants())]


def naive(q, k, v, q_start_pos, scale, softcap, window=None, sinks=None):
    """q [Q, H, D] at positions q_start_pos.., k/v [L, Hkv, D] -> [Q, H, D] in float64, causal."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(q.shape[0])[:, None] + q_start_pos
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.fixture(scope="module")
def paged_libraries(tmp_path_factory):
    return isa_variants.build_all("paged_attention", tmp_path_factory)


@pytest.fixture(scope="module")
def varlen_libraries(tmp_path_factory):
    return isa_variants.build_all("varlen_attention", tmp_path_factory)


def _which(variant: str) -> str | None:
    return None if variant == "reference" else variant


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_with_softcap(monkeypatch, paged_libraries, variant, head_dim, num_kv_heads, group, window, batch):
    gen = torch.Generator().manual_seed(head_dim + batch)
    seq_lens = [37, 9, 70][:batch]
    key_cache, value_cache, block_tables, keys, values = scatter_to_cache(seq_lens, 16, num_kv_heads, head_dim, gen)
    query = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen)
    args = (query, key_cache, value_cache, block_tables, torch.tensor(seq_lens), SCALE, window)
    out = run_attention(monkeypatch, paged_libraries, _which(variant), "paged_decode_attention", *args, softcap=CAP)
    for b, n in enumerate(seq_lens):
        want = naive(query[b : b + 1], keys[b], values[b], n - 1, SCALE, CAP, window)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=1e-4)
    uncapped = ref.paged_decode_attention(*args)
    assert not torch.allclose(out, uncapped, atol=1e-3)  # (the cap mattered)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_varlen_with_softcap(monkeypatch, varlen_libraries, variant, head_dim, num_kv_heads, group, window):
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 17, 70]
    q = torch.randn(sum(lens), num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    args = (q, k, v, starts, SCALE, True, window)
    out = run_attention(monkeypatch, varlen_libraries, _which(variant), "varlen_attention", *args, softcap=CAP)
    for b, n in enumerate(lens):
        s = int(starts[b])
        want = naive(q[s : s + n], k[s : s + n], v[s : s + n], 0, SCALE, CAP, window)
        torch.testing.assert_close(out[s : s + n].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_paged_prefill_with_softcap(monkeypatch, varlen_libraries, variant, head_dim, num_kv_heads, group, window):
    """Chunks of each sequence's last tokens over a cached prefix (chunked prefill, prefix-cache hits)."""
    gen = torch.Generator().manual_seed(head_dim + 1)
    seq_lens, chunks = [40, 23, 9], [12, 23, 1]
    key_cache, value_cache, block_tables, keys, values = scatter_to_cache(seq_lens, 16, num_kv_heads, head_dim, gen)
    query = torch.randn(sum(chunks), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    args = (query, key_cache, value_cache, block_tables, starts, torch.tensor(seq_lens), SCALE, window)
    out = run_attention(monkeypatch, varlen_libraries, _which(variant), "paged_prefill_attention", *args, softcap=CAP)
    for b, (n, c) in enumerate(zip(seq_lens, chunks, strict=True)):
        s = int(starts[b])
        want = naive(query[s : s + c], keys[b], values[b], n - c, SCALE, CAP, window)
        torch.testing.assert_close(out[s : s + c].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["reference", "native"])
def test_softcap_with_sinks(monkeypatch, paged_libraries, varlen_libraries, variant):
    """Both options at once (no model has both, but the kernels take them independently)."""
    gen = torch.Generator().manual_seed(9)
    seq_lens = [37, 9]
    key_cache, value_cache, block_tables, keys, values = scatter_to_cache(seq_lens, 16, 2, 32, gen)
    query = torch.randn(2, 4, 32, generator=gen)
    sinks = torch.randn(4, generator=gen)
    args = (query, key_cache, value_cache, block_tables, torch.tensor(seq_lens), SCALE, 5)
    out = run_attention(
        monkeypatch, paged_libraries, _which(variant), "paged_decode_attention", *args, sinks=sinks, softcap=CAP
    )
    for b, n in enumerate(seq_lens):
        want = naive(query[b : b + 1], keys[b], values[b], n - 1, SCALE, CAP, 5, sinks)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=1e-4)
    q, k, v = (torch.randn(20, h, 32, generator=gen) for h in (4, 2, 2))
    starts = torch.tensor([0, 20])
    out = run_attention(
        monkeypatch, varlen_libraries, _which(variant), "varlen_attention", q, k, v, starts, SCALE, True, None,
        sinks=sinks, softcap=CAP,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), naive(q, k, v, 0, SCALE, CAP, None, sinks), atol=2e-5, rtol=1e-4)


# ---- Triton (the interpreter on the CPU, or a GPU) ------------------------------------------------------


def _triton_modules():
    pytest.importorskip("triton")
    from pagoda.kernels.triton import attention as triton_attention
    from pagoda.kernels.triton import varlen_attention as triton_varlen

    return triton_attention, triton_varlen


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_decode_with_softcap(window):
    triton_attention, _ = _triton_modules()
    gen = torch.Generator().manual_seed(11)
    seq_lens = [37, 9, 70]
    key_cache, value_cache, block_tables, _, _ = scatter_to_cache(seq_lens, 16, 2, 32, gen)
    query = torch.randn(3, 4, 32, generator=gen)
    lens = torch.tensor(seq_lens)
    want = ref.paged_decode_attention(query, key_cache, value_cache, block_tables, lens, SCALE, window, softcap=CAP)
    device = torch.get_default_device()
    inputs = (query, key_cache, value_cache, block_tables, lens)
    got = triton_attention.paged_decode_attention(*(x.to(device) for x in inputs), SCALE, window, softcap=CAP)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_paged_prefill_with_softcap(window):
    triton_attention, _ = _triton_modules()
    gen = torch.Generator().manual_seed(12)
    seq_lens, chunks = [40, 23, 9], [12, 23, 1]
    key_cache, value_cache, block_tables, _, _ = scatter_to_cache(seq_lens, 16, 2, 32, gen)
    query = torch.randn(sum(chunks), 4, 32, generator=gen)
    starts, lens = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()]), torch.tensor(seq_lens)
    inputs = (query, key_cache, value_cache, block_tables, starts, lens)
    want = ref.paged_prefill_attention(*inputs, SCALE, window, softcap=CAP)
    device = torch.get_default_device()
    got = triton_attention.paged_prefill_attention(*(x.to(device) for x in inputs), SCALE, window, softcap=CAP)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_varlen_with_softcap(window):
    _, triton_varlen = _triton_modules()
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(40, h, 32, generator=gen) for h in (4, 2, 2))
    starts = torch.tensor([0, 17, 40])
    want = ref.varlen_attention(q, k, v, starts, SCALE, True, window, softcap=CAP)
    device = torch.get_default_device()
    got = triton_varlen.varlen_attention(*(x.to(device) for x in (q, k, v, starts)), SCALE, True, window, softcap=CAP)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got.cpu(), ref.varlen_attention(q, k, v, starts, SCALE, True, window), atol=1e-3)

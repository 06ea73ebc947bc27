"""Variable-length attention with no cache (pooling models), causal and bidirectional: the torch reference,
the compiled CPU kernel and the Triton kernel (Triton's interpreter on the CPU, compiled on a GPU) against
naive float64 attention per sequence.

Inputs are strided views of one fused QKV-like tensor, as the model passes them; Triton's output buffer is
poisoned with NaN, so an unwritten element fails. Sequence lengths cover one token, tile edges (8-row and
32-key tiles in C, 64-row tiles in Triton), an empty sequence and lengths past a tile.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import cpu
from pagoda.kernels.torch_ref import attention as ref

LENS = [1, 5, 16, 17, 0, 37, 70]
# (head_dim, num_kv_heads, query heads per kv head)
SHAPES = [(32, 12, 1), (64, 2, 4), (128, 1, 8), (96, 2, 3)]
# (causal, sliding window)
MODES = [(False, None), (True, None), (True, 7)]


def naive(q, k, v, lens, scale, causal, window):
    """Per sequence, in float64: softmax(q k^T * scale) v with the mask spelled out."""
    out, start = [], 0
    groups = q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start : start + n].double()
        ks = k[start : start + n].double().repeat_interleave(groups, dim=1)
        vs = v[start : start + n].double().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        pos = torch.arange(n)
        allowed = torch.ones(n, n, dtype=torch.bool)
        if causal:
            allowed &= pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        scores = scores.masked_fill(~allowed, -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


def inputs(head_dim, num_kv_heads, group, lens, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v as views of one [T, (H + 2 Hkv) * D] tensor, and query_start_loc."""
    gen = torch.Generator(device=device).manual_seed(seed + head_dim + group)
    heads = num_kv_heads * group
    fused = torch.randn(sum(lens), (heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device).to(dtype)
    q, k, v = fused.split([heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    shape = lambda x, h: x.view(-1, h, head_dim)  # noqa: E731
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    return shape(q, heads), shape(k, num_kv_heads), shape(v, num_kv_heads), starts


@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("causal,window", MODES)
def test_torch_reference_matches_naive(head_dim, num_kv_heads, group, causal, window):
    q, k, v, starts = inputs(head_dim, num_kv_heads, group, LENS)
    out = ref.varlen_attention(q, k, v, starts, head_dim**-0.5, causal, window)
    torch.testing.assert_close(out.double(), naive(q, k, v, LENS, head_dim**-0.5, causal, window), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("causal,window", MODES)
def test_compiled_cpu_kernel_matches_naive(head_dim, num_kv_heads, group, causal, window):
    assert cpu.available()
    lens = LENS * 2  # enough work for several threads
    q, k, v, starts = inputs(head_dim, num_kv_heads, group, lens, seed=1)
    out = cpu.varlen_attention(q, k, v, starts, head_dim**-0.5, causal, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), naive(q, k, v, lens, head_dim**-0.5, causal, window), atol=2e-5, rtol=1e-4)


def test_compiled_cpu_kernel_on_one_long_sequence():
    """Longer than any tile, one sequence: what a single long embedding input runs, and a prompt's prefill
    (its rows are split into jobs of 64; a window of 100 reaches back over a job's start)."""
    q, k, v, starts = inputs(32, 12, 1, [300], seed=2)
    for causal, window in ((False, None), (True, None), (True, 100)):
        out = cpu.varlen_attention(q, k, v, starts, 32**-0.5, causal, window)
        expected = naive(q, k, v, [300], 32**-0.5, causal, window)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_a_window_without_causality_is_refused():
    q, k, v, starts = inputs(32, 2, 1, [4])
    with pytest.raises(ValueError, match="causal"):
        ref.varlen_attention(q, k, v, starts, 1.0, causal=False, sliding_window=2)
    with pytest.raises(ValueError, match="causal"):
        cpu.varlen_attention(q, k, v, starts, 1.0, causal=False, sliding_window=2)


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("head_dim,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("causal,window", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_naive(head_dim, num_kv_heads, group, causal, window, dtype):
    pytest.importorskip("triton")
    from pagoda.kernels.triton.varlen_attention import varlen_attention
    from tests.kernels.devices import DEVICE

    lens = [1, 17, 0, 70, 130]
    q, k, v, starts = inputs(head_dim, num_kv_heads, group, lens, dtype, device=DEVICE, seed=3)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    varlen_attention(q, k, v, starts, head_dim**-0.5, causal, window, out=out)
    assert not out.isnan().any(), "NaN in the output: an element was left unwritten"
    expected = naive(q.cpu(), k.cpu(), v.cpu(), lens, head_dim**-0.5, causal, window)
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.cpu().double(), expected, **tolerance)

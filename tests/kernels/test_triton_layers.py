"""The Triton element-wise/normalization kernels against the torch references, on the CPU through
Triton's interpreter (the GPU runs the same kernels compiled).

Fresh outputs are allocated NaN-poisoned while a kernel runs, so an element the kernel fails to
write shows up as NaN, and NaN never passes. Under the interpreter fp32 -> bf16 casts truncate
instead of rounding to nearest (the GPU rounds to nearest even), so bf16 results may sit an ulp or
two off the reference's: bf16 tolerances allow that. fp16 (rounded correctly by numpy) is held to
about an ulp, and rotary, which has no reduction, to the bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagoda.kernels.torch_ref import layers as ref
from pagoda.kernels.triton import layers as tri
from tests.kernels.devices import make_generator
from tests.kernels.poison import poisoned_empty

pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_matches(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert not ours.isnan().any(), "NaN in the kernel's output"
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, **TOL[expected.dtype])


def assert_rounds_like_reference(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """fp16 only: with the reference's rounding points nearly every element is bit-identical. A
    reduction summed in another order may flip a rare rounding, so this is not torch.equal."""
    if expected.dtype == torch.float16:
        assert (ours != expected).float().mean() < 0.01


def scaled_rows(rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows whose RMS spans 1e-3..10: the small ones make eps matter (an eps bug shows there)."""
    scales = torch.logspace(-3, 1, rows)[:, None] if rows > 1 else torch.ones(1, 1)
    return (torch.randn(rows, hidden, generator=gen) * scales).to(dtype)


def random_weight(hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)  # not ones: the multiply must happen


def fused_qkv(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one fused projection output, the way the model makes them."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        qkv,
        q.reshape(tokens, heads, head_dim),
        k.reshape(tokens, kv_heads, head_dim),
        v.reshape(tokens, kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (9, 576), (5, 100)])
def test_rms_norm(dtype, rows, hidden):
    gen = make_generator(rows * hidden)
    x, w = scaled_rows(rows, hidden, dtype, gen), random_weight(hidden, dtype, gen)
    original = x.clone()
    with poisoned_empty():
        out = tri.rms_norm(x, w, 1e-5)
    expected = ref.rms_norm(x, w, 1e-5)
    assert_matches(out, expected)
    assert_rounds_like_reference(out, expected)
    assert torch.equal(x, original)  # the input is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_on_strided_head_view(dtype, head_dim):
    """The q/k norms of Qwen3: [T, heads, D] views of a fused QKV output, rows not evenly spaced."""
    gen = make_generator(head_dim)
    _, q, k, _ = fused_qkv(5, 4, 2, head_dim, dtype, gen)
    w = random_weight(head_dim, dtype, gen)
    for x in (q, k, q.transpose(0, 1)):  # the transpose: rows at a head-major spacing
        with poisoned_empty():
            out = tri.rms_norm(x, w, 1e-6)
        assert_matches(out, ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (9, 576), (5, 100)])
def test_fused_add_rms_norm_in_place(dtype, rows, hidden):
    gen = make_generator(7 + rows * hidden)
    x, residual = scaled_rows(rows, hidden, dtype, gen), scaled_rows(rows, hidden, dtype, gen).flip(0)
    w = random_weight(hidden, dtype, gen)
    expected_normed, expected_residual = ref.fused_add_rms_norm(x, residual, w, 1e-5)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    normed, new_residual = tri.fused_add_rms_norm(x, residual, w, 1e-5)
    assert (normed.data_ptr(), new_residual.data_ptr()) == (x_ptr, residual_ptr)  # the documented in-place
    # The sum is one rounding in x's dtype on both sides: held to that dtype's tolerance like the rest.
    assert_matches(new_residual, expected_residual)
    assert_matches(normed, expected_normed)
    assert_rounds_like_reference(normed, expected_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 100), (7, 2 * 1100), (2, 3, 2 * 96)])
def test_silu_and_mul(dtype, shape):
    """I = 1100 spans two column blocks with a ragged tail; a 3-D input keeps its leading dims."""
    gen = make_generator(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    with poisoned_empty():
        out = tri.silu_and_mul(x)
    assert_matches(out, ref.silu_and_mul(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, under the interpreter
def test_silu_and_mul_extreme_gates_give_no_nan():
    x = torch.tensor([[-1e4, 1e4, -100.0, 2.0, 3.0, -4.0]])  # gate | up; exp(1e4) overflows to inf
    assert_matches(tri.silu_and_mul(x), ref.silu_and_mul(x))


def cos_sin_cache(rot_dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rotary_embedding_in_place_on_fused_qkv_views(dtype, neox, head_dim, rot_dim):
    gen = make_generator(head_dim + rot_dim + neox)
    # Ragged positions: three sequences' chunks in one batch, as a mixed prefill/decode step makes them.
    positions = torch.tensor([0, 1, 2, 3, 4, 17, 18, 500, 1023])
    qkv, q, k, _v = fused_qkv(len(positions), 6, 2, head_dim, dtype, gen)
    cache = cos_sin_cache(rot_dim, 1024)
    expected_q, expected_k = ref.rotary_embedding(positions, q.clone(), k.clone(), cache, neox)
    original_qkv = qkv.clone()
    out_q, out_k = tri.rotary_embedding(positions, q, k, cache, neox)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert_matches(out_q, expected_q)
    assert_matches(out_k, expected_k)
    if dtype != torch.bfloat16:  # same ops, same rounding points, no reduction: exact (see module doc)
        assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    q_size = q.shape[1] * head_dim
    assert torch.equal(qkv[:, q_size + k.shape[1] * head_dim :], original_qkv[:, q_size + k.shape[1] * head_dim :]), (
        "v must be untouched"
    )
    for now, before in ((q, original_qkv[:, :q_size]), (k, original_qkv[:, q_size : q_size + k.shape[1] * head_dim])):
        before = before.reshape(now.shape)
        assert torch.equal(now[..., rot_dim:], before[..., rot_dim:]), "dims past rot_dim must be untouched"
        moved = (now[1:, :, :rot_dim] != before[1:, :, :rot_dim]).any(-1)
        assert moved.all(), "every head of every token past position 0 must rotate"


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_on_head_major_views(neox):
    """q/k transposed from [heads, T, D] storage: head stride != D and token stride == D."""
    gen = make_generator(5)
    q = torch.randn(4, 6, 64, generator=gen).transpose(0, 1)
    k = torch.randn(2, 6, 64, generator=gen).transpose(0, 1)
    positions, cache = torch.tensor([3, 9, 0, 1, 2, 60]), cos_sin_cache(64, 64)
    expected_q, expected_k = ref.rotary_embedding(positions, q.clone(), k.clone(), cache, neox)
    out_q, out_k = tri.rotary_embedding(positions, q, k, cache, neox)
    assert_matches(out_q, expected_q)
    assert_matches(out_k, expected_k)


def test_rotary_embedding_single_token_int32_positions():
    gen = make_generator(1)
    q, k = torch.randn(1, 3, 64, generator=gen), torch.randn(1, 1, 64, generator=gen)
    positions, cache = torch.tensor([37], dtype=torch.int32), cos_sin_cache(64, 64)
    expected_q, expected_k = ref.rotary_embedding(positions, q, k, cache, True)
    out_q, out_k = tri.rotary_embedding(positions, q, k, cache, True)
    assert_matches(out_q, expected_q)
    assert_matches(out_k, expected_k)


def test_zero_rows_return_empty_outputs():
    x, w = torch.empty(0, 576), torch.ones(576)
    assert tri.rms_norm(x, w, 1e-6).shape == (0, 576)
    normed, residual = tri.fused_add_rms_norm(x, x.clone(), w, 1e-6)
    assert normed.shape == residual.shape == (0, 576)
    assert tri.silu_and_mul(torch.empty(0, 200)).shape == (0, 100)
    q, k = tri.rotary_embedding(
        torch.empty(0, dtype=torch.long), torch.empty(0, 4, 64), torch.empty(0, 2, 64), cos_sin_cache(64, 16)
    )
    assert q.shape == (0, 4, 64) and k.shape == (0, 2, 64)

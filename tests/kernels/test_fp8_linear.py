"""FP8 linears (kernels/fp8.py): `torch._scaled_mm` with per-token activation scales, against the same
arithmetic in float64. On a GPU (benchmarks/gpu_check.sh) this is cuBLASLt's FP8 GEMM in bfloat16; on
the CPU, torch's CPU `_scaled_mm` in float32 (slow, never chosen by the loader there, but the same
contract), so the quantization of activations and the scale layout are checked here on every run.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import fp8, ops
from pagoda.kernels.fp8 import Fp8Weight, quantize_per_channel, quantize_per_token
from tests.kernels.devices import DEVICE, make_generator

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, Fp8Weight]:
    w = torch.randn(n, k, generator=make_generator(seed), device=DEVICE) * 0.05
    w[:, 3] *= 20  # an outlier column: per-channel scales must still hold the other columns
    return w, quantize_per_channel(w)


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_linear_is_the_fp8_arithmetic(m, bias):
    """y = sx[m] * sw[n] * (xq @ wq^T) (+ b): exactly what the kernel is asked to compute, in float64."""
    n, k = 96, 160
    _, w = _weight(n, k, seed=m)
    x = (torch.randn(2, m, k, generator=make_generator(100 + m), device=DEVICE) * 3).to(DTYPE)
    b = torch.randn(n, generator=make_generator(7), device=DEVICE).to(DTYPE) if bias else None
    out = fp8.scaled_mm_linear(x, w, b)
    assert out.shape == (2, m, n) and out.dtype == DTYPE
    xq, sx = quantize_per_token(x.reshape(-1, k))
    expected = (xq.double() * sx.double()) @ (w.weight.double() * w.scale.double()[:, None]).t()
    if b is not None:
        expected += b.double()
    tol = 1e-2 if DEVICE == "cuda" else 1e-5  # the output's rounding (bf16 on the GPU)
    torch.testing.assert_close(out.reshape(-1, n).double(), expected, rtol=tol, atol=tol * expected.abs().max())


def test_fp8_output_is_close_to_the_full_precision_linear():
    """Against the float weight: the error is that of two FP8 roundings (3 mantissa bits each), a few %
    of the output's scale, far below what a wrong scale, row or transpose gives."""
    w_full, w = _weight(128, 256, seed=1)
    x = torch.randn(8, 256, generator=make_generator(2), device=DEVICE).to(DTYPE)
    exact = x.double() @ w_full.double().t()
    out = fp8.scaled_mm_linear(x, w).double()
    assert (out - exact).abs().max() < 0.08 * exact.abs().max()
    weight_only = fp8.reference_linear(x, w).double()  # the dequantized weight, activations in float
    assert (weight_only - exact).abs().max() < 0.04 * exact.abs().max()


def test_per_channel_quantization_round_trip():
    w_full, w = _weight(64, 96, seed=3)
    assert w.weight.dtype == torch.float8_e4m3fn and w.scale.shape == (64,)
    assert torch.equal(w.weight.float().abs().amax(dim=1), torch.full((64,), fp8.E4M3_MAX, device=DEVICE))
    # E4M3 keeps 3 mantissa bits: each element within 2^-4 of itself relative, or of the subnormal step.
    step = torch.maximum(w_full.abs() * 2.0**-4, w.scale[:, None] * 2.0**-9)
    assert bool(((w.dequantize() - w_full).abs() <= step).all())
    ids = torch.tensor([[5, 0], [63, 5]], device=DEVICE)
    assert torch.equal(w.rows(ids, torch.float32), w.dequantize()[ids])
    merged = Fp8Weight.concat([w, w])
    assert merged.out_features == 128 and torch.equal(merged.dequantize()[64:], w.dequantize())


def test_where_fp8_matmuls_run():
    assert not fp8.supported(torch.device("cpu"), torch.bfloat16, 64, 64)
    assert ops.implementation("fp8_linear", torch.device("cuda")) is fp8.scaled_mm_linear
    assert ops.implementation("fp8_linear", torch.device("cpu")) is fp8.reference_linear
    if DEVICE == "cuda":
        dev = torch.device("cuda")
        assert not fp8.supported(dev, torch.bfloat16, 64, 72)  # K not a multiple of 16
        assert not fp8.supported(dev, torch.float32, 64, 64)
        assert fp8.supported(dev, torch.bfloat16, 64, 64) == (torch.cuda.get_device_capability() >= (8, 9))
